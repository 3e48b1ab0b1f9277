package daemon

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
)

// TestHeapReleaseAfterBursts: the heap is released once a burst of
// switches is over, not after fewer switches, not for writes that changed
// nothing, and not while the burst goes on.
func TestHeapReleaseAfterBursts(t *testing.T) {
	var released atomic.Int32
	h := &heapRelease{quiet: time.Second, release: func() { released.Add(1) }}
	t.Cleanup(h.stop)
	switched := reconcile.ProjectedEvent{Mount: "m", Change: projector.Change{Changed: []string{"f"}}}
	unchanged := reconcile.ProjectedEvent{Mount: "m"}

	for range burstWrites - 1 {
		h.Observe(switched)
	}
	for range 10 * burstWrites {
		h.Observe(unchanged)
	}
	h.Observe(reconcile.PassEvent{})
	time.Sleep(h.quiet * 3 / 2)
	if n := released.Load(); n != 0 {
		t.Fatalf("released %d times after %d switches; want none before %d", n, burstWrites-1, burstWrites)
	}

	// The burst's last switch, then more for twice the quiet time: each
	// puts the release off.
	h.Observe(switched)
	for range 20 {
		time.Sleep(h.quiet / 10)
		h.Observe(switched)
	}
	if n := released.Load(); n != 0 {
		t.Fatalf("released %d times while the burst went on; want none", n)
	}
	for deadline := time.Now().Add(10 * time.Second); released.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the heap was never released after the burst")
		}
	}
	time.Sleep(h.quiet * 3 / 2)
	if n := released.Load(); n != 1 {
		t.Fatalf("released %d times after one burst; want 1", n)
	}

	// The count starts again: a few switches later, nothing more.
	for range burstWrites / 2 {
		h.Observe(switched)
	}
	time.Sleep(h.quiet * 3 / 2)
	if n := released.Load(); n != 1 {
		t.Fatalf("released %d times; want 1 (half a burst since)", n)
	}
}
