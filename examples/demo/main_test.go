package main

import (
	"os"
	"testing"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/daemon"
)

// TestMain lets the daemon start this binary again as its worker.
func TestMain(m *testing.M) {
	daemon.MaybeWorker(registry())
	os.Exit(m.Run())
}

// TestDemo runs the demo as make demo does: it must succeed, and the time
// it reports is the switch's — what readers see —, not the removal of the
// replaced version after its 5 s grace (issue 37, 7).
func TestDemo(t *testing.T) {
	switched, err := run(false)
	if err != nil {
		t.Fatal(err)
	}
	if switched <= 0 || switched >= config.DefaultKeepReplaced {
		t.Errorf("the demo reports the change %v after the write; want the switch, before keep_replaced (%v) ends", switched, config.DefaultKeepReplaced)
	}
}
