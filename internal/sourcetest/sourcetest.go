// Package sourcetest follows a source in a test and records what it
// publishes, for the tests of every source kind.
package sourcetest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvmount/kvmount/source"
)

// Timeout bounds every wait; changes arrive in milliseconds, so it is only
// reached when something is broken.
const Timeout = 30 * time.Second

// Discard is a logger for sources under test.
var Discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// Recorder is a source.Publisher that keeps every snapshot and the last
// status. It is safe for concurrent use.
type Recorder struct {
	// Limit is what Limits returns: none unless a test sets it before
	// the follow starts.
	Limit source.Limits

	mu       sync.Mutex
	snaps    []source.Snapshot
	err      error
	errs     []error
	statuses int
	currents int
	changed  chan struct{}
}

// NewRecorder returns an empty Recorder.
func NewRecorder() *Recorder { return &Recorder{changed: make(chan struct{}, 1)} }

// Publish records s and clears the status.
func (r *Recorder) Publish(s source.Snapshot) {
	r.mu.Lock()
	r.snaps = append(r.snaps, s)
	r.err = nil
	r.mu.Unlock()
	r.wake()
}

// Limits returns r.Limit.
func (r *Recorder) Limits() source.Limits { return r.Limit }

// Status records err.
func (r *Recorder) Status(err error) {
	r.mu.Lock()
	r.err = err
	if err != nil {
		r.errs = append(r.errs, err)
	} else {
		r.currents++
	}
	r.statuses++
	r.mu.Unlock()
	r.wake()
}

// Errors returns every error reported through Status, oldest first.
func (r *Recorder) Errors() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.errs)
}

// Statuses returns how many times Status was called: a source that polls
// reports each poll that found no change this way, so a test can wait for
// a number of polls instead of sleeping.
func (r *Recorder) Statuses() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.statuses
}

// Currents returns how many times Status reported the source current
// (a nil error): a test can tell a flicker to current between two errors,
// which State alone may miss.
func (r *Recorder) Currents() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.currents
}

func (r *Recorder) wake() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// State returns the snapshots published so far and the last status.
func (r *Recorder) State() ([]source.Snapshot, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.snaps), r.err
}

// A Condition is what WaitFor waits for.
type Condition func(snaps []source.Snapshot, err error) bool

// WaitFor waits, at most Timeout, until cond holds.
func (r *Recorder) WaitFor(tb testing.TB, what string, cond Condition) {
	tb.Helper()
	deadline := time.After(Timeout)
	for {
		snaps, err := r.State()
		if cond(snaps, err) {
			return
		}
		select {
		case <-r.changed:
		case <-deadline:
			tb.Fatalf("timed out waiting for %s; %d snapshots, last %s, status %v", what, len(snaps), Render(Last(snaps)), err)
		}
	}
}

// Last returns the last of snaps, or nil.
func Last(snaps []source.Snapshot) *source.Snapshot {
	if len(snaps) == 0 {
		return nil
	}
	return &snaps[len(snaps)-1]
}

// Holds is the condition that the last snapshot holds exactly want.
func Holds(want map[string]string) Condition {
	return func(snaps []source.Snapshot, _ error) bool {
		last := Last(snaps)
		return last != nil && maps.EqualFunc(last.Entries.Map(), want, func(v []byte, w string) bool { return string(v) == w })
	}
}

// Missing is the condition that the last snapshot reports a missing prefix.
func Missing(snaps []source.Snapshot, _ error) bool {
	last := Last(snaps)
	return last != nil && last.Missing && last.Entries.Len() == 0
}

// Failing is the condition that the source reports a failure.
func Failing(_ []source.Snapshot, err error) bool { return err != nil }

// Healthy is the condition that the source reports no failure.
func Healthy(_ []source.Snapshot, err error) bool { return err == nil }

// Render shows a snapshot's entries, shortened when large.
func Render(s *source.Snapshot) string {
	if s == nil {
		return "none"
	}
	if s.Entries.Len() > 20 {
		return fmt.Sprintf("%d entries at %s", s.Entries.Len(), s.Revision)
	}
	m := make(map[string]string, s.Entries.Len())
	for k, v := range s.Entries.All() {
		m[k] = string(v)
	}
	return fmt.Sprintf("%v at %s", m, s.Revision)
}

// Follow runs src.Follow(prefix) until the test ends, then checks that it
// returns context.Canceled promptly, and returns the Recorder it publishes
// to.
func Follow(tb testing.TB, src source.Source, prefix string) *Recorder {
	tb.Helper()
	return FollowLimited(tb, src, prefix, source.Limits{})
}

// FollowLimited is Follow with a Recorder whose Limits are lim.
func FollowLimited(tb testing.TB, src source.Source, prefix string, lim source.Limits) *Recorder {
	tb.Helper()
	rec, _ := FollowStoppable(tb, src, prefix, lim)
	return rec
}

// FollowStoppable is FollowLimited whose follow the test can end before it
// ends itself: stop cancels it with cause (such as source.ErrReleased, the
// cache's when no mount follows a prefix any more) and waits until Follow
// has returned context.Canceled. Calls after the first do nothing.
func FollowStoppable(tb testing.TB, src source.Source, prefix string, lim source.Limits) (*Recorder, func(cause error)) {
	tb.Helper()
	rec := NewRecorder()
	rec.Limit = lim
	ctx, cancel := context.WithCancelCause(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Follow(ctx, prefix, rec) }()
	var once sync.Once
	stop := func(cause error) {
		once.Do(func() {
			cancel(cause)
			select {
			case err := <-done:
				if !errors.Is(err, context.Canceled) {
					tb.Errorf("Follow returned %v; want context.Canceled", err)
				}
			case <-time.After(Timeout):
				tb.Errorf("Follow did not return after cancel")
			}
		})
	}
	tb.Cleanup(func() { stop(nil) })
	return rec, stop
}
