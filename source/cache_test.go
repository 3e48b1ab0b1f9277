package source

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"
)

// fakeSource counts its follows and publishes one snapshot per follow.
// Beside the real-store tests of each kind, it checks the cache's own
// bookkeeping.
type fakeSource struct {
	name    string
	mu      sync.Mutex
	running map[string]int
	started int
	closed  bool
}

func newFake(name string) *fakeSource { return &fakeSource{name: name, running: map[string]int{}} }

func (f *fakeSource) Follow(ctx context.Context, prefix string, pub Publisher) error {
	f.mu.Lock()
	f.running[prefix]++
	f.started++
	f.mu.Unlock()
	pub.Publish(Snapshot{Revision: f.name, Entries: map[string][]byte{"k": []byte(f.name)}})
	<-ctx.Done()
	f.mu.Lock()
	f.running[prefix]--
	f.mu.Unlock()
	return ctx.Err()
}

func (f *fakeSource) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	return nil
}

func (f *fakeSource) state() (running map[string]int, started int, closed bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]int{}
	for k, v := range f.running {
		if v != 0 {
			out[k] = v
		}
	}
	return out, f.started, f.closed
}

func waitRevision(t *testing.T, f *Feed, want string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if st := f.State(); st.Snapshot != nil && st.Snapshot.Revision == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("feed never got a snapshot from %s", want)
		}
		time.Sleep(time.Millisecond)
	}
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

func TestCacheSharesOneFollowPerPrefix(t *testing.T) {
	src := newFake("one")
	c := NewCache(discard, func() {})
	c.SetSources(map[string]Source{"main": src})
	a, err := c.Acquire("main", "/p/")
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Acquire("main", "/p/")
	if err != nil {
		t.Fatal(err)
	}
	other, err := c.Acquire("main", "/q/")
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Errorf("two acquires of one prefix returned two feeds")
	}
	waitRevision(t, a, "one")
	waitRevision(t, other, "one")
	if running, started, _ := src.state(); running["/p/"] != 1 || running["/q/"] != 1 || started != 2 {
		t.Errorf("running %v, started %d; want one follow per prefix", running, started)
	}
	c.Release(a)
	if running, _, _ := src.state(); running["/p/"] != 1 {
		t.Errorf("released one of two users and the follow stopped")
	}
	c.Release(b)
	if running, _, _ := src.state(); running["/p/"] != 0 {
		t.Errorf("released every user and the follow runs on: %v", running)
	}
	c.Close()
	if running, _, closed := src.state(); len(running) != 0 || !closed {
		t.Errorf("after Close: running %v, closed %v", running, closed)
	}
	if _, err := c.Acquire("main", "/p/"); err == nil {
		t.Errorf("Acquire after Close succeeded")
	}
}

func TestCacheRestartsFeedsOfAChangedSource(t *testing.T) {
	one, two := newFake("one"), newFake("two")
	c := NewCache(discard, func() {})
	defer c.Close()
	c.SetSources(map[string]Source{"main": one})
	f, err := c.Acquire("main", "/p/")
	if err != nil {
		t.Fatal(err)
	}
	waitRevision(t, f, "one")
	c.SetSources(map[string]Source{"main": two})
	waitRevision(t, f, "two")
	if running, _, closed := one.state(); len(running) != 0 || !closed {
		t.Errorf("old source: running %v, closed %v; want stopped and closed", running, closed)
	}
	c.SetSources(map[string]Source{})
	if st := f.State(); st.Err == nil || st.Snapshot == nil || st.Snapshot.Revision != "two" {
		t.Errorf("feed of a removed source = %+v; want its last snapshot and an error", st)
	}
	if _, err := c.Acquire("main", "/x/"); err == nil {
		t.Errorf("Acquire of a removed source succeeded")
	}
}

func TestFeedStatus(t *testing.T) {
	var n int
	c := NewCache(discard, func() { n++ })
	f := &Feed{cache: c}
	f.Status(nil)
	if n != 0 || f.State().Version != 0 {
		t.Errorf("healthy status on a healthy feed woke the listener")
	}
	boom := errors.New("boom")
	f.Status(boom)
	f.Status(errors.New("boom"))
	if st := f.State(); n != 1 || st.Err == nil {
		t.Errorf("status error: %d wakes, state %+v; want one wake and the error", n, st)
	}
	f.Publish(Snapshot{Revision: "1"})
	if st := f.State(); n != 2 || st.Err != nil || st.Snapshot == nil {
		t.Errorf("publish: %d wakes, state %+v; want the snapshot and no error", n, st)
	}
}
