package main

import "testing"

// TestDemo runs the demo as make demo does: it must succeed.
func TestDemo(t *testing.T) {
	if err := run(false); err != nil {
		t.Fatal(err)
	}
}
