package source

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"
)

// TestFanout: one loop for all followers, started by the first Join and
// stopped by the last Leave; Wake reaches the followers it concerns.
func TestFanout(t *testing.T) {
	var running, started atomic.Int32
	stopped := make(chan struct{}, 10)
	f := NewFanout(func(ctx context.Context) {
		running.Add(1)
		started.Add(1)
		<-ctx.Done()
		running.Add(-1)
		stopped <- struct{}{}
	})
	a := f.Join("a/")
	b := f.Join("b/")
	for _, fl := range []*Follower{a, b} {
		select {
		case <-fl.Wake: // the join's wake-up
		default:
			t.Errorf("%s: no wake-up at Join", fl.Prefix)
		}
	}
	if got := slices.Sorted(slices.Values(f.Prefixes())); !slices.Equal(got, []string{"a/", "b/"}) {
		t.Errorf("Prefixes = %v", got)
	}
	f.Wake(func(fl *Follower) bool { return fl.Prefix == "b/" })
	select {
	case <-a.Wake:
		t.Errorf("a woken by news for b/")
	case <-b.Wake:
	case <-time.After(time.Second):
		t.Errorf("b not woken")
	}
	f.Leave(a)
	select {
	case <-stopped:
		t.Fatal("the loop stopped while b still follows")
	default:
	}
	f.Leave(b)
	<-stopped // Leave waited for it
	if running.Load() != 0 || started.Load() != 1 {
		t.Errorf("loop started %d times, %d running; want 1 and 0", started.Load(), running.Load())
	}
	c := f.Join("c/")
	defer f.Leave(c)
	for deadline := time.Now().Add(5 * time.Second); started.Load() != 2; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the loop did not start again")
		}
	}
}
