package topology

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// history records what a store acknowledged and what the readers of
// mounts saw, for checks that read it whole, as Jepsen's and etcd's
// robustness checkers read theirs: never a mixed version, never
// backwards, and every acknowledged write visible within a bar — counted
// from the write, or from the end of the outage it fell in.
type history struct {
	mu      sync.Mutex
	acked   []write
	reads   map[string][]sample
	outages []window
	// back is a value the store was restored to: each reader may step
	// back to it once. unjudged are windows whose writes the silent-lag
	// check leaves out (a restore forgets them).
	back     int
	unjudged []window
}

// write is a value the store acknowledged at a time.
type write struct {
	n  int
	at time.Time
}

// sample is the value a reader saw in a mount at a time.
type sample struct {
	n  int
	at time.Time
}

// window is a stretch of time in which the store did not answer, for
// every mount, or — when mount is not "" — for that mount's source alone.
type window struct {
	what     string
	mount    string
	from, to time.Time
}

func newHistory() *history { return &history{reads: map[string][]sample{}} }

// ack records that the store acknowledged n at at.
func (h *history) ack(n int, at time.Time) {
	h.mu.Lock()
	h.acked = append(h.acked, write{n, at})
	h.mu.Unlock()
}

// outage records that the store did not answer from from to to.
func (h *history) outage(what string, from, to time.Time) {
	h.outageOf("", what, from, to)
}

// outageOf records that the source of mount did not answer from from to
// to, while the store did.
func (h *history) outageOf(mount, what string, from, to time.Time) {
	h.mu.Lock()
	h.outages = append(h.outages, window{what, mount, from, to})
	h.mu.Unlock()
}

// outagesOf returns the windows that apply to mount.
func (h *history) outagesOf(mount string) []window {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []window
	for _, o := range h.outages {
		if o.mount == "" || o.mount == mount {
			out = append(out, o)
		}
	}
	return out
}

// restoring says the store is about to be restored to value n: each
// reader may step back to it once; writes acknowledged from since until
// the restore ends are left out of the silent-lag check (done).
func (h *history) restoring(n int, since time.Time) (done func()) {
	h.mu.Lock()
	h.back = n
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		h.unjudged = append(h.unjudged, window{what: "restore", from: since, to: time.Now()})
		h.mu.Unlock()
	}
}

// unjudgedOf leaves the writes acknowledged from from to to out of
// mount's silent-lag check: a fault the test knows kvmount cannot see.
func (h *history) unjudgedOf(mount, what string, from, to time.Time) {
	h.mu.Lock()
	h.unjudged = append(h.unjudged, window{what: what, mount: mount, from: from, to: to})
	h.mu.Unlock()
}

// silentLags returns the acknowledged writes that mount did not show
// within limit while st said it was current: from limit after a write
// until a reader saw it (or a later value), /status must not say current.
// That is the promise of a status that tells the truth.
func (h *history) silentLags(mount string, st *states, limit time.Duration) []string {
	h.mu.Lock()
	acked := slices.Clone(h.acked)
	reads := slices.Clone(h.reads[mount])
	unjudged := slices.Clone(h.unjudged)
	h.mu.Unlock()
	if len(reads) == 0 {
		return []string{"no reads"}
	}
	end := reads[len(reads)-1].at
	const slack = 300 * time.Millisecond // /status is sampled every 100 ms
	var out []string
	j := 0
	for _, w := range acked {
		if w.at.Add(limit).After(end) {
			break
		}
		skip := false
		for _, u := range unjudged {
			if (u.mount == "" || u.mount == mount) && !w.at.Before(u.from) && !w.at.After(u.to) {
				skip = true
			}
		}
		for j < len(reads) && (reads[j].n < w.n || reads[j].at.Before(w.at)) {
			j++
		}
		if skip {
			continue
		}
		seen := end
		if j < len(reads) {
			seen = reads[j].at
		}
		from, to := w.at.Add(limit), seen.Add(-slack)
		if !to.After(from) {
			continue
		}
		if at, ok := st.during(mount, "current", from, to); ok {
			out = append(out, fmt.Sprintf("%d written at %s, seen at %s, while /status said current at %s", w.n,
				w.at.Format("15:04:05.000"), seen.Format("15:04:05.000"), at.Format("15:04:05.000")))
		}
	}
	return out
}

// lagWithin returns the longest time mount took to show a write
// acknowledged from from to to (a later value counts), up to now for one
// not shown yet.
func (h *history) lagWithin(mount string, from, to time.Time) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	reads := h.reads[mount]
	var longest time.Duration
	for _, w := range h.acked {
		if w.at.Before(from) || w.at.After(to) {
			continue
		}
		seen := time.Now()
		for _, r := range reads {
			if r.n >= w.n && !r.at.Before(w.at) {
				seen = r.at
				break
			}
		}
		longest = max(longest, seen.Sub(w.at))
	}
	return longest
}

// waitHeld waits, for at most waitTimeout, until every one of mounts was
// last read holding the last acknowledged write (or a later one), and
// fails the test naming the first that does not; after says what just
// happened, st is logged with the failure.
func (h *history) waitHeld(t testing.TB, after string, mounts []string, st *states) {
	t.Helper()
	want := h.lastAcked()
	deadline := time.Now().Add(waitTimeout)
	for _, m := range mounts {
		for {
			h.mu.Lock()
			reads := h.reads[m]
			got := 0
			if len(reads) > 0 {
				got = reads[len(reads)-1].n
			}
			h.mu.Unlock()
			if got >= want {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("after %s: %s holds %d, the store %d\n%s", after, m, got, want, st)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// lastAcked returns the last acknowledged value, 0 before any.
func (h *history) lastAcked() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.acked) == 0 {
		return 0
	}
	return h.acked[len(h.acked)-1].n
}

// read follows the mount in dir until ctx is done: every 20 ms it
// resolves ..data once and reads the files n and check below prefix in
// that one version; the two always hold the same number, or the mount
// showed a mix of two versions.
func (h *history) read(ctx context.Context, t testing.TB, mount, dir, prefix string) {
	var last int
	for ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
		target, err := os.Readlink(filepath.Join(dir, "..data"))
		if err != nil {
			continue
		}
		a, errA := os.ReadFile(filepath.Join(dir, target, prefix, "n"))
		b, errB := os.ReadFile(filepath.Join(dir, target, prefix, "check"))
		if errA != nil || errB != nil {
			continue // the version was replaced between the reads
		}
		at := time.Now()
		if string(a) != string(b) {
			t.Errorf("%s: a mixed version %s: n = %q, check = %q", mount, target, a, b)
			continue
		}
		n, err := strconv.Atoi(strings.TrimSpace(string(a)))
		if err != nil {
			t.Errorf("%s: n = %q", mount, a)
			continue
		}
		if n < last {
			h.mu.Lock()
			restored := n == h.back
			h.mu.Unlock()
			if !restored {
				t.Errorf("%s went backwards at %s: %d after %d", mount, at.Format("15:04:05.000"), n, last)
			}
		}
		last = n
		h.mu.Lock()
		h.reads[mount] = append(h.reads[mount], sample{n, at})
		h.mu.Unlock()
	}
}

// lags returns, for the mount, the writes that took longer than bar to be
// seen, counted from the write or — when an outage began before the bar
// had passed — from the end of that outage, and the longest lag. Writes acknowledged less than bar before the last
// read are not judged.
func (h *history) lags(mount string, bar time.Duration) (late []string, longest time.Duration) {
	h.mu.Lock()
	defer h.mu.Unlock()
	reads := h.reads[mount]
	if len(reads) == 0 {
		return []string{"no reads"}, 0
	}
	end := reads[len(reads)-1].at
	var outages []window
	for _, o := range h.outages {
		if o.mount == "" || o.mount == mount {
			outages = append(outages, o)
		}
	}
	slices.SortFunc(outages, func(a, b window) int { return a.from.Compare(b.from) })
	j := 0
	for _, w := range h.acked {
		if w.at.Add(bar).After(end) {
			break
		}
		for j < len(reads) && (reads[j].n < w.n || reads[j].at.Before(w.at)) {
			j++
		}
		seen := end.Add(time.Hour)
		if j < len(reads) {
			seen = reads[j].at
		}
		// An outage that began before the write was seen, and before
		// its bar had passed, restarts the bar at its end: the store
		// answered again then.
		from := w.at
		for _, o := range outages {
			if !o.from.After(seen) && !o.from.After(from.Add(bar)) && o.to.After(from) {
				from = o.to
			}
		}
		lag := max(seen.Sub(from), 0) // 0: seen before the probes saw the store back
		longest = max(longest, lag)
		if lag > bar {
			late = append(late, fmt.Sprintf("%d written at %s, seen %v later", w.n, w.at.Format("15:04:05.000"), lag.Round(time.Millisecond)))
		}
	}
	return late, longest
}
