package reconcile

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

// BenchmarkPass measures one pass of the reconciler's loop over 1,000
// projected mounts of one key each when nothing is to be done: the pass
// that follows every operation's result, and the work every pass does
// besides its operations (populate, plan; the status, which the observer
// discards, at most every statusEvery, so in few of the passes measured).
// Run with: go test -run '^$' -bench Pass ./reconcile
func BenchmarkPass(b *testing.B) {
	const n = 1000
	cache := newFakeCache()
	var mounts []*config.Mount
	for i := range n {
		prefix := fmt.Sprintf("p%04d/", i)
		mounts = append(mounts, testMount(fmt.Sprintf("m%04d", i), prefix))
		cache.feed("main", prefix).publish("7", map[string]string{"key": fmt.Sprint(i)})
	}
	r, pop := benchReconciler(b, cache, mounts)
	for name, d := range pop.Populate() {
		r.asw.Mounts[name] = &ActualMount{Dir: d.Spec.Dir, Medium: d.Spec.Medium, Generation: d.Generation}
	}
	b.ReportAllocs()
	for b.Loop() {
		r.pass(time.Now())
	}
	if len(r.asw.InFlight) > 0 {
		b.Fatalf("a pass started %d operations; want none", len(r.asw.InFlight))
	}
}

// BenchmarkPassRestart measures one pass of the reconciler's loop during a
// restart of 1,000 mounts of 100 keys, while the sources' first reads are
// still coming: every mount but one has its payload, equal to what the
// previous run left (its manifest's digest), and waits to be adopted
// until the last one is read (holdForFirstReads). Each payload that
// arrives then is followed by such a pass, which starts nothing. Run
// with: go test -run '^$' -bench PassRestart ./reconcile
func BenchmarkPassRestart(b *testing.B) {
	const n, keys = 1000, 100
	cache := newFakeCache()
	var mounts []*config.Mount
	for i := range n + 1 {
		prefix := fmt.Sprintf("p%04d/", i)
		mounts = append(mounts, testMount(fmt.Sprintf("m%04d", i), prefix))
		if i == n {
			break // the one whose first read has not come
		}
		entries := make(map[string]string, keys)
		for k := range keys {
			entries[fmt.Sprintf("key-%03d", k)] = fmt.Sprintf("value %d of mount %d", k, i)
		}
		cache.feed("main", prefix).publish("7", entries)
	}
	r, pop := benchReconciler(b, cache, mounts)
	for name, d := range pop.Populate() {
		r.asw.Mounts[name] = &ActualMount{Dir: d.Spec.Dir, Medium: d.Spec.Medium}
		if d.Ready() {
			r.asw.Mounts[name].DiskDigest = d.Payload.Digest()
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		// Within firstReadsWait of the start, however long the run.
		r.startedAt = time.Now()
		r.pass(r.startedAt)
	}
	if len(r.asw.InFlight) > 0 || r.readsDone {
		b.Fatalf("a pass started %d operations (first reads done: %v); want none", len(r.asw.InFlight), r.readsDone)
	}
}

// benchReconciler returns a reconciler of mounts over cache, with no
// mount in its actual state, and its populator; its passes are not
// checked (verifyPlans) until the benchmark ends.
func benchReconciler(b *testing.B, cache *fakeCache, mounts []*config.Mount) (*Reconciler, *Populator) {
	b.Helper()
	// What is measured is a pass as it runs in kvmount, not checked
	// against a plan of every mount as this package's tests check it.
	verify := verifyPlans
	verifyPlans = false
	b.Cleanup(func() { verifyPlans = verify })
	pop := NewPopulatorFor(cache, discard)
	if err := pop.SetMounts(mounts); err != nil {
		b.Fatal(err)
	}
	owned, err := LoadOwned(filepath.Join(b.TempDir(), "state"))
	if err != nil {
		b.Fatal(err)
	}
	return New(pop, owned, NewTrigger(), discard, Options{ResyncInterval: time.Hour}), pop
}

// BenchmarkPlanColdStart measures the plan of one pass in the middle of a
// cold start of 1,000 mounts: 500 projected, 500 to set up, each of which
// is checked against the projected mounts' directories (takenDirs). Run
// with: go test -run '^$' -bench PlanColdStart ./reconcile
func BenchmarkPlanColdStart(b *testing.B) {
	const n = 1000
	dsw := DesiredState{}
	asw := NewActualState()
	var names []string
	for i := range n {
		name := fmt.Sprintf("m%04d", i)
		dir := filepath.Join("/srv/kvmount/projected-mounts", name)
		names = append(names, name)
		dsw[name] = &DesiredMount{Spec: &config.Mount{Dir: dir, Medium: config.MediumDisk}, Payload: projector.Payload{}, Generation: 1}
		if i%2 == 0 {
			asw.Mounts[name] = &ActualMount{Dir: dir, Medium: config.MediumDisk, Generation: 1}
		}
	}
	now := time.Now()
	b.ReportAllocs()
	for b.Loop() {
		if ops, _ := planSorted(names, dsw, asw, now, nil); len(ops) != n/2 {
			b.Fatalf("%d operations; want %d setups", len(ops), n/2)
		}
	}
}

// BenchmarkUpdateOneOf1000Mounts measures one update of one mount among
// 1,000 projected ones (and, as mounts=1, of a mount alone), through the
// reconciler's loop as it runs it: the pass that the new snapshot's
// wake-up makes (which starts the remount), the write itself on an
// executor (b.TempDir: set TMPDIR=/dev/shm for tmpfs), its result
// applied, and the pass after it. Run with:
// go test -run '^$' -bench UpdateOneOf1000Mounts ./reconcile
func BenchmarkUpdateOneOf1000Mounts(b *testing.B) {
	for _, n := range []int{1, 1000} {
		b.Run(fmt.Sprintf("mounts=%d", n), func(b *testing.B) { benchUpdateOneOf(b, n) })
	}
}

// benchUpdateOneOf is BenchmarkUpdateOneOf1000Mounts with n mounts.
func benchUpdateOneOf(b *testing.B, n int) {
	cache := newFakeCache()
	base := b.TempDir()
	var mounts []*config.Mount
	for i := range n {
		prefix := fmt.Sprintf("p%04d/", i)
		m := testMount(fmt.Sprintf("m%04d", i), prefix)
		m.Dir = filepath.Join(base, "mnt", m.Name)
		mounts = append(mounts, m)
		cache.feed("main", prefix).publish("7", map[string]string{"key": fmt.Sprint(i)})
	}
	r, _ := benchReconciler(b, cache, mounts)
	settle := func() {
		for {
			r.pass(time.Now())
			if len(r.asw.InFlight) == 0 {
				return
			}
			r.apply(<-r.results)
			r.applyPending()
		}
	}
	settle()
	if len(r.asw.Mounts) != n {
		b.Fatalf("%d mounts projected; want %d", len(r.asw.Mounts), n)
	}
	feed := cache.feed("main", fmt.Sprintf("p%04d/", n/2))
	i := 0
	b.ReportAllocs()
	for b.Loop() {
		i++
		feed.publish("8", map[string]string{"key": fmt.Sprint("update ", i)})
		r.pass(time.Now())
		if len(r.asw.InFlight) != 1 {
			b.Fatalf("%d operations in flight after an update; want 1", len(r.asw.InFlight))
		}
		r.apply(<-r.results)
		r.pass(time.Now())
	}
}
