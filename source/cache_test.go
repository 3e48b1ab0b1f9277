package source

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmount/kvmount/kvset"
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
	// causes are the causes of the follows' ends, in order.
	causes []error
}

func newFake(name string) *fakeSource { return &fakeSource{name: name, running: map[string]int{}} }

func (f *fakeSource) Follow(ctx context.Context, prefix string, pub Publisher) error {
	f.mu.Lock()
	f.running[prefix]++
	f.started++
	f.mu.Unlock()
	pub.Publish(Snapshot{Revision: f.name, Entries: kvset.FromMap(map[string][]byte{"k": []byte(f.name)})})
	<-ctx.Done()
	f.mu.Lock()
	f.running[prefix]--
	f.causes = append(f.causes, context.Cause(ctx))
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
	a, err := c.Acquire("main", "/p/", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Acquire("main", "/p/", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	other, err := c.Acquire("main", "/q/", Limits{})
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
	c.Release(a, Limits{})
	if running, _, _ := src.state(); running["/p/"] != 1 {
		t.Errorf("released one of two users and the follow stopped")
	}
	c.Release(b, Limits{})
	if running, _, _ := src.state(); running["/p/"] != 0 {
		t.Errorf("released every user and the follow runs on: %v", running)
	}
	c.Close()
	if running, _, closed := src.state(); len(running) != 0 || !closed {
		t.Errorf("after Close: running %v, closed %v", running, closed)
	}
	if _, err := c.Acquire("main", "/p/", Limits{}); err == nil {
		t.Errorf("Acquire after Close succeeded")
	}
}

func TestCacheRestartsFeedsOfAChangedSource(t *testing.T) {
	one, two := newFake("one"), newFake("two")
	c := NewCache(discard, func() {})
	defer c.Close()
	c.SetSources(map[string]Source{"main": one})
	f, err := c.Acquire("main", "/p/", Limits{})
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
	if _, err := c.Acquire("main", "/x/", Limits{}); err == nil {
		t.Errorf("Acquire of a removed source succeeded")
	}
}

// TestFollowEndCause: a follow whose last use is released ends with the
// cause ErrReleased (a source revokes its leases then); one replaced on a
// new instance of its source, or stopped with the cache, ends otherwise.
func TestFollowEndCause(t *testing.T) {
	src := newFake("one")
	c := NewCache(discard, func() {})
	c.SetSources(map[string]Source{"main": src})
	a, err := c.Acquire("main", "/a/", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	waitRevision(t, a, "one")
	c.Release(a, Limits{})
	b, err := c.Acquire("main", "/b/", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	waitRevision(t, b, "one")
	replacement := newFake("two")
	c.SetSources(map[string]Source{"main": replacement})
	waitRevision(t, b, "two")
	c.Close()
	src.mu.Lock()
	causes := append([]error(nil), src.causes...)
	src.mu.Unlock()
	replacement.mu.Lock()
	causes = append(causes, replacement.causes...)
	replacement.mu.Unlock()
	if len(causes) != 3 || !errors.Is(causes[0], ErrReleased) || errors.Is(causes[1], ErrReleased) || errors.Is(causes[2], ErrReleased) {
		t.Errorf("causes %v; want ErrReleased for the released follow only", causes)
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

// TestFeedKeepsWithinItsLimits: a feed keeps no value larger than the
// largest max_value_size of its uses (the key goes to Oversized, by size),
// and no snapshot over their keys or bytes — it reports ErrOverLimits and
// keeps the last one. Its limits are its uses' merged: the larger bound of
// each, none where a use has none; they change as uses come and go.
func TestFeedKeepsWithinItsLimits(t *testing.T) {
	c := NewCache(discard, func() {})
	c.SetSources(map[string]Source{"main": newFake("main")})
	defer c.Close()
	small := Limits{MaxKeys: 2, MaxValueSize: 3, MaxBytes: 4}
	f, err := c.Acquire("main", "/p/", small)
	if err != nil {
		t.Fatal(err)
	}
	if got := f.Limits(); got != small {
		t.Errorf("limits of one use = %+v; want %+v", got, small)
	}
	waitRevision(t, f, "main") // the fake follow's own snapshot, first
	f.Publish(Snapshot{Revision: "1", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1"), "big": []byte("12345")})})
	st := f.State()
	if st.Snapshot == nil || st.Snapshot.Entries.Len() != 1 || st.Snapshot.Oversized["big"] != 5 {
		t.Fatalf("state %+v; want a kept and big oversized (5 bytes)", st)
	}
	f.Publish(Snapshot{Revision: "2", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1"), "b": []byte("2"), "c": []byte("3")})})
	if st := f.State(); !errors.Is(st.Err, ErrOverLimits) || st.Snapshot.Revision != "1" {
		t.Errorf("three keys under MaxKeys 2: state %+v; want ErrOverLimits and revision 1 kept", st)
	}
	larger := Limits{MaxKeys: 10, MaxValueSize: 2, MaxBytes: 0}
	if _, err := c.Acquire("main", "/p/", larger); err != nil {
		t.Fatal(err)
	}
	if got, want := f.Limits(), (Limits{MaxKeys: 10, MaxValueSize: 3}); got != want {
		t.Errorf("merged limits = %+v; want %+v", got, want)
	}
	c.Release(f, larger)
	if got := f.Limits(); got != small {
		t.Errorf("limits after a release = %+v; want %+v", got, small)
	}
	c.Release(f, small)
}

// TestBoundRevision: a revision a server chose is kept as it is when short
// and plain, else as a hash — distinct for distinct revisions.
func TestBoundRevision(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"1042", "1042"},
		{`W/"abc-123"`, `W/"abc-123"`},
		{strings.Repeat("e", 128), strings.Repeat("e", 128)},
	} {
		if got := BoundRevision(tt.in); got != tt.want {
			t.Errorf("BoundRevision(%q) = %q; want %q", tt.in, got, tt.want)
		}
	}
	long := strings.Repeat("e", 300_000)
	for _, in := range []string{long, long + "x", "with space", "ctl\x1b[2J", "é"} {
		got := BoundRevision(in)
		if !strings.HasPrefix(got, "sha256:") || len(got) != 7+32 {
			t.Errorf("BoundRevision(%.20q) = %q; want a hash", in, got)
		}
	}
	if BoundRevision(long) == BoundRevision(long+"x") {
		t.Error("two long revisions bound to one")
	}
}

// TestCacheTakeChanged: TakeChanged yields each feed whose state changed
// since the last call once, however often it changed, and not a feed that
// did not change or whose status stayed the same; a feed released after
// its change is forgotten with its follow.
func TestCacheTakeChanged(t *testing.T) {
	c := NewCache(discard, func() {})
	c.SetSources(map[string]Source{"s": newFake("s")})
	a, err := c.Acquire("s", "/a/", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Acquire("s", "/b/", Limits{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	waitRevision(t, a, "s")
	waitRevision(t, b, "s")
	take := func() map[*Feed]int {
		got := map[*Feed]int{}
		c.TakeChanged(func(f *Feed) { got[f]++ })
		return got
	}
	if got := take(); got[a] != 1 || got[b] != 1 || len(got) != 2 {
		t.Fatalf("after the first snapshots: %v, want a and b once each", got)
	}
	if got := take(); len(got) != 0 {
		t.Fatalf("nothing changed: %v", got)
	}
	a.Publish(Snapshot{Revision: "2"})
	a.Status(errors.New("boom"))
	a.Publish(Snapshot{Revision: "3"})
	b.Status(nil) // healthy already: no change
	if got := take(); got[a] != 1 || len(got) != 1 {
		t.Fatalf("a changed three times, b not: %v, want a once", got)
	}
	b.Publish(Snapshot{Revision: "2"})
	c.Release(b, Limits{})
	if got := take(); len(got) != 0 {
		t.Fatalf("b changed, then was released: %v, want nothing", got)
	}
}
