package reconcile

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
)

// BenchmarkPass measures one pass of the reconciler's loop over 1,000
// projected mounts of one key each when nothing is to be done: the pass
// that follows every operation's result, and the work every pass does
// besides its operations (populate, plan, status; the observer discards
// the status). Run with: go test -run '^$' -bench Pass ./reconcile
func BenchmarkPass(b *testing.B) {
	const n = 1000
	cache := newFakeCache()
	var mounts []*config.Mount
	for i := range n {
		prefix := fmt.Sprintf("p%04d/", i)
		mounts = append(mounts, testMount(fmt.Sprintf("m%04d", i), prefix))
		cache.feed("main", prefix).publish("7", map[string]string{"key": fmt.Sprint(i)})
	}
	pop := NewPopulatorFor(cache, discard)
	if err := pop.SetMounts(mounts); err != nil {
		b.Fatal(err)
	}
	owned, err := LoadOwned(filepath.Join(b.TempDir(), "state"))
	if err != nil {
		b.Fatal(err)
	}
	r := New(pop, owned, NewTrigger(), discard, Options{ResyncInterval: time.Hour})
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
