package reconcile

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

// scheduler returns a reconciler with only what schedule needs.
func scheduler() *Reconciler {
	return &Reconciler{asw: NewActualState(), running: map[string]opClass{}, digests: map[string]digestAt{}}
}

func desired(gen uint64, value string) *DesiredMount {
	return &DesiredMount{Spec: &config.Mount{}, Generation: gen, Payload: projector.Payload{"k": {Data: []byte(value), Mode: 0o644}}}
}

func started(ops []Op) map[string]bool {
	out := map[string]bool{}
	for _, op := range ops {
		out[op.Mount] = true
	}
	return out
}

// TestScheduleKeepsASlotForAChange starts 40 new mounts and the update of
// a projected one, named last: the update starts first, the setups take
// MaxOperations - 1 slots, and while they run a second update still finds
// the slot kept for it.
func TestScheduleKeepsASlotForAChange(t *testing.T) {
	r := scheduler()
	dsw := DesiredState{}
	var ops []Op
	for i := range 40 {
		name := fmt.Sprintf("m%02d", i)
		dsw[name] = desired(1, "v")
		ops = append(ops, Op{Kind: Setup, Mount: name})
	}
	dsw["zz"] = desired(2, "new")
	r.asw.Mounts["zz"] = &ActualMount{Generation: 1}
	ops = append(ops, Op{Kind: Remount, Mount: "zz"})
	start, _ := r.schedule(ops, dsw, time.Now())
	if len(start) != MaxOperations || start[0].Mount != "zz" {
		t.Fatalf("started %v; want zz first and %d in all", start, MaxOperations)
	}
	// Later: the setups still run, and another mount's update comes.
	delete(r.running, "zz")
	dsw["zy"] = desired(2, "new")
	r.asw.Mounts["zy"] = &ActualMount{Generation: 1}
	start, _ = r.schedule([]Op{{Kind: Setup, Mount: "m39"}, {Kind: Remount, Mount: "zy"}}, dsw, time.Now())
	if got := started(start); !got["zy"] || got["m39"] {
		t.Errorf("started %v; want the update zy and no more bulk work", start)
	}
}

// TestScheduleAdoptsChangedContentFirst: of the mounts a previous run
// left, the one whose payload's digest differs from the digest on disk
// is a change; the others, and one whose digest is unknown (no manifest),
// are bulk work.
func TestScheduleAdoptsChangedContentFirst(t *testing.T) {
	r := scheduler()
	dsw := DesiredState{}
	var ops []Op
	n := MaxOperations + 14
	name := func(i int) string { return fmt.Sprintf("m%03d", i) }
	for i := range n {
		d := desired(1, "v")
		dsw[name(i)] = d
		r.asw.Mounts[name(i)] = &ActualMount{DiskDigest: d.Payload.Digest()}
		ops = append(ops, Op{Kind: Remount, Mount: name(i)})
	}
	unknown, changed := name(n-2), name(n-1)
	r.asw.Mounts[unknown].DiskDigest = ""                                 // no manifest: unknown
	r.asw.Mounts[changed].DiskDigest = desired(1, "old").Payload.Digest() // changed while down
	start, _ := r.schedule(ops, dsw, time.Now())
	if start[0].Mount != changed || started(start)[unknown] {
		t.Errorf("started %v; want %s first, %s waiting with the rest", start, changed, unknown)
	}
	if r.running[changed] != classChange || r.running[name(0)] != classBulk {
		t.Errorf("classes %v; want %s a change, %s bulk", r.running, changed, name(0))
	}
}

// TestSchedulePacesVerification: a verification waits while bulk work
// waits, runs one at a time, and the next starts no sooner than verifyPace
// times the last one's duration after it ended.
func TestSchedulePacesVerification(t *testing.T) {
	r := scheduler()
	dsw := DesiredState{}
	var bulk []Op
	for i := range MaxOperations {
		name := fmt.Sprintf("b%02d", i)
		dsw[name] = desired(1, "v")
		bulk = append(bulk, Op{Kind: Setup, Mount: name})
	}
	verify := []Op{{Kind: Verify, Mount: "v1"}, {Kind: Verify, Mount: "v2"}}
	now := time.Now()
	start, _ := r.schedule(append(bulk, verify...), dsw, now)
	if got := started(start); got["v1"] || got["v2"] {
		t.Fatalf("a verification started while bulk work waits: %v", start)
	}
	r.running = map[string]opClass{}
	start, _ = r.schedule(verify, dsw, now)
	if len(start) != 1 || start[0].Mount != "v1" {
		t.Fatalf("started %v; want v1 alone", start)
	}
	r.finished("v1", 10*time.Millisecond, now)
	start, at := r.schedule(verify[1:], dsw, now.Add(20*time.Millisecond))
	if len(start) != 0 || !at.Equal(now.Add(30*time.Millisecond)) {
		t.Errorf("started %v, next at %v; want none before %v", start, at.Sub(now), 30*time.Millisecond)
	}
	if start, _ = r.schedule(verify[1:], dsw, now.Add(30*time.Millisecond)); len(start) != 1 {
		t.Errorf("started %v after the pause; want v2", start)
	}
}
