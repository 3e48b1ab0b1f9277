package main

import (
	"os"
	"testing"

	"github.com/kvmount/kvmount/daemon"
)

// TestMain lets the daemon start this binary again as its worker.
func TestMain(m *testing.M) {
	daemon.MaybeWorker(registry())
	os.Exit(m.Run())
}

// TestDemo runs the demo as make demo does: it must succeed.
func TestDemo(t *testing.T) {
	if err := run(false); err != nil {
		t.Fatal(err)
	}
}
