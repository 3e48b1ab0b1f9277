package reconcile

import (
	"container/heap"
	"fmt"
	"os"
	"slices"
	"time"
)

// A pass plans the mounts whose state may have moved, not every mount: at
// 1,000 mounts a plan of every one took 94–107 µs of the monitor's CPU,
// on each of the two passes an update takes (BenchmarkPass), where one
// update moves one mount. The rules are Plan's; which mounts they are
// applied to is what changes keeps:
//
//   - a mount is planned again when its desired state moved (the
//     Desired's ChangeReporter, or every mount when the Desired is not
//     one), when its actual state did (an operation's result, an
//     adoption, a release, a resync: every mount), and when a time its
//     plan depended on comes (its replaced versions' grace, its
//     quiescence, its backoff);
//   - a mount that was planned stays planned on every pass while it has
//     an operation — in flight, or planned and not started (no free slot,
//     held for the first reads, its directory still another mount's, its
//     payload asked for again): whether it starts depends on other mounts
//     too;
//   - every other mount is quiet: its plan gave nothing, and gives
//     nothing until one of the above.
//
// With KVMOUNT_VERIFY_PLAN set in the environment (make test sets it),
// every pass plans every mount as well and panics where the two differ.

// verifyPlans is whether each pass checks its plan against a plan of
// every mount (KVMOUNT_VERIFY_PLAN).
var verifyPlans = os.Getenv("KVMOUNT_VERIFY_PLAN") != ""

// changes is what lets a pass plan only the mounts whose state may have
// moved since the last. The reconciler's loop owns it.
type changes struct {
	// all is whether every mount is to be planned; dirty are the mounts
	// to be planned otherwise.
	all   bool
	dirty map[string]struct{}
	// quietUntil is each quiet mount's next time to be planned again,
	// when its plan depended on one; due orders those times, with
	// entries that quietUntil no longer holds dropped as they come up.
	quietUntil map[string]time.Time
	due        dueHeap
	// names is the sorted list of dirty mounts a pass plans; kept, so
	// that a pass allocates none.
	names []string
	// planning is set during a pass that plans every mount, and held
	// collects the mounts that pass leaves to be planned again
	// (beginAll, endAll).
	planning bool
	held     []string
}

func newChanges() *changes {
	return &changes{all: true, dirty: map[string]struct{}{}, quietUntil: map[string]time.Time{}}
}

// markAll has every mount planned at the next pass.
func (c *changes) markAll() { c.all = true }

// mark has mount planned at the next pass.
func (c *changes) mark(mount string) {
	c.dirty[mount] = struct{}{}
	delete(c.quietUntil, mount)
}

// take returns the mounts to plan at now, sorted, with those whose time
// has come (quietUntil) among them; all is true when every mount is to
// be planned instead (beginAll): after markAll, or when many of the n
// mounts are to be planned (bulk) — as in a restart, whose
// operations wait for the first reads, where sorting a thousand names on
// every pass cost more than planning every mount in the order the
// reconciler keeps them in. The mounts stay to be planned until settle
// says otherwise.
func (c *changes) take(now time.Time, n int) (names []string, all bool) {
	for len(c.due) > 0 && !now.Before(c.due[0].at) {
		e := heap.Pop(&c.due).(dueAt)
		if at, ok := c.quietUntil[e.mount]; ok && at.Equal(e.at) {
			c.mark(e.mount)
		}
	}
	if c.all || bulk(len(c.dirty), n) {
		return nil, true
	}
	c.names = c.names[:0]
	for name := range c.dirty {
		c.names = append(c.names, name)
	}
	slices.Sort(c.names)
	return c.names, false
}

// bulk reports whether k mounts to plan of n are enough that a pass
// plans every mount instead: a quarter of them, and at least bulkPlan.
func bulk(k, n int) bool { return k >= bulkPlan && 4*k >= n }

// bulkPlan is the fewest mounts to plan for which a pass plans every
// mount (bulk): below it, sorting their names costs less than a plan of
// every mount, whatever the number of mounts.
const bulkPlan = 64

// beginAll starts a pass that plans every mount: what is known of each
// is found anew.
func (c *changes) beginAll() {
	clear(c.quietUntil)
	c.due = c.due[:0]
	clear(c.dirty)
	c.held = c.held[:0]
	c.planning = true
}

// endAll ends a pass that planned every mount, n of them: the mounts it
// left to be planned again are the next pass's, unless they are many
// (bulk) — then the next pass plans every mount too.
func (c *changes) endAll(n int) {
	c.planning = false
	if bulk(len(c.held), n) {
		c.all = true
		return
	}
	c.all = false
	for _, mount := range c.held {
		c.dirty[mount] = struct{}{}
	}
}

// settle records how a pass left mount (planSorted): quiet until at
// (zero: until its state moves), or to be planned again at the next pass.
// A mount is never both to be planned and quiet: mark and settle keep
// dirty and quietUntil apart.
func (c *changes) settle(mount string, quiet bool, at time.Time) {
	if !quiet {
		if c.planning {
			c.held = append(c.held, mount)
		} else {
			c.dirty[mount] = struct{}{}
		}
		return
	}
	delete(c.dirty, mount)
	if at.IsZero() {
		delete(c.quietUntil, mount)
		return
	}
	if old, ok := c.quietUntil[mount]; ok && old.Equal(at) {
		return
	}
	c.quietUntil[mount] = at
	heap.Push(&c.due, dueAt{at: at, mount: mount})
}

// next returns the earliest time a quiet mount is to be planned again,
// zero if none is.
func (c *changes) next() time.Time {
	for len(c.due) > 0 {
		e := c.due[0]
		if at, ok := c.quietUntil[e.mount]; ok && at.Equal(e.at) {
			return e.at
		}
		heap.Pop(&c.due)
	}
	return time.Time{}
}

// dueAt is a quiet mount's time to be planned again.
type dueAt struct {
	at    time.Time
	mount string
}

// dueHeap is a min-heap of dueAt by time (container/heap).
type dueHeap []dueAt

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h dueHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *dueHeap) Push(x any)        { *h = append(*h, x.(dueAt)) }
func (h *dueHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// verifyPlan panics unless ops and retry, a pass's plan of the mounts
// changes gave it, are what a plan of every mount gives at now, and
// unless every projected mount's PendingSince is what markPending over
// every mount would leave it (KVMOUNT_VERIFY_PLAN).
func (r *Reconciler) verifyPlan(dsw DesiredState, now time.Time, ops []Op, retry time.Time) {
	for name, a := range r.asw.Mounts {
		d := dsw[name]
		if (d == nil || !d.Ready() || a.Generation == d.Generation) != a.PendingSince.IsZero() {
			panic(fmt.Sprintf("reconcile: KVMOUNT_VERIFY_PLAN: mount %q: PendingSince %v is not what markPending over every mount leaves", name, a.PendingSince))
		}
	}
	want, wantRetry := planSorted(withTeardowns(r.names, dsw, r.asw), dsw, r.asw, now, nil)
	if !slices.Equal(ops, want) || !retry.Equal(wantRetry) {
		panic(fmt.Sprintf("reconcile: KVMOUNT_VERIFY_PLAN: a pass planned %v, retry at %v; a plan of every mount gives %v, retry at %v", ops, retry, want, wantRetry))
	}
}
