package reconcile

import (
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

// scheduler returns a reconciler with only what schedule needs, started
// long ago (no first read holds anything back), with room for MaxSetups.
func scheduler() *Reconciler {
	return &Reconciler{
		log: slog.New(slog.DiscardHandler), asw: NewActualState(),
		running: map[string]opClass{}, digests: map[string]digestAt{},
		openFiles: 1 << 20, procs: &procs{fixed: true},
	}
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

// TestScheduleKeepsASlotForAChange adopts 40 mounts a previous run left
// and updates a projected one, named last: the update starts first, the
// adoptions take MaxOperations - 1 slots, and while they run a second
// update still finds the slot kept for it.
func TestScheduleKeepsASlotForAChange(t *testing.T) {
	r := scheduler()
	dsw := DesiredState{}
	var ops []Op
	for i := range 40 {
		name := fmt.Sprintf("m%02d", i)
		dsw[name] = desired(1, "v")
		r.asw.Mounts[name] = &ActualMount{} // adopted, digest unknown
		ops = append(ops, Op{Kind: Remount, Mount: name})
	}
	dsw["zz"] = desired(2, "new")
	r.asw.Mounts["zz"] = &ActualMount{Generation: 1}
	ops = append(ops, Op{Kind: Remount, Mount: "zz"})
	start, _ := r.schedule(ops, dsw, time.Now())
	if len(start) != MaxOperations || start[0].Mount != "zz" {
		t.Fatalf("started %v; want zz first and %d in all", start, MaxOperations)
	}
	// Later: the adoptions still run, and another mount's update comes.
	delete(r.running, "zz")
	dsw["zy"] = desired(2, "new")
	r.asw.Mounts["zy"] = &ActualMount{Generation: 1}
	start, _ = r.schedule([]Op{{Kind: Remount, Mount: "m39"}, {Kind: Remount, Mount: "zy"}}, dsw, time.Now())
	if got := started(start); !got["zy"] || got["m39"] {
		t.Errorf("started %v; want the update zy and no more bulk work", start)
	}
}

// TestScheduleRunsSetupsBeside: new mounts are set up MaxSetups at a time,
// beside adoptions, which keep their MaxOperations - 1 slots.
func TestScheduleRunsSetupsBeside(t *testing.T) {
	r := scheduler()
	dsw := DesiredState{}
	var ops []Op
	for i := range MaxSetups + 10 {
		name := fmt.Sprintf("new%04d", i)
		dsw[name] = desired(1, "v")
		ops = append(ops, Op{Kind: Setup, Mount: name})
	}
	for i := range 40 {
		name := fmt.Sprintf("old%02d", i)
		dsw[name] = desired(1, "v")
		r.asw.Mounts[name] = &ActualMount{}
		ops = append(ops, Op{Kind: Remount, Mount: name})
	}
	start, _ := r.schedule(ops, dsw, time.Now())
	var setups, bulk int
	for _, op := range start {
		switch r.running[op.Mount] {
		case classSetup:
			setups++
		case classBulk:
			bulk++
		}
	}
	if setups != MaxSetups || bulk != MaxOperations-1 {
		t.Errorf("started %d setups and %d adoptions; want %d and %d", setups, bulk, MaxSetups, MaxOperations-1)
	}
}

// TestSetupLimit: MaxSetups when the open-file limit has room, fewer when
// it does not, never fewer than MaxOperations - 1.
func TestSetupLimit(t *testing.T) {
	for _, tc := range []struct {
		soft    uint64
		writers int
		want    int
	}{
		{1 << 20, 1000, MaxSetups},
		{65536, 1000, MaxSetups},
		{20000, 1000, MaxSetups},
		{6000, 1000, (6000 - reservedFiles - 1000) / projector.MaxOpenFiles},
		{4096, 1000, (4096 - reservedFiles - 1000) / projector.MaxOpenFiles},
		{1024, 10, MaxOperations - 1},
		{1024, 5000, MaxOperations - 1},
		{0, 0, MaxOperations - 1},
	} {
		if got := setupLimit(tc.soft, tc.writers); got != tc.want {
			t.Errorf("setupLimit(%d, %d) = %d; want %d", tc.soft, tc.writers, got, tc.want)
		}
	}
}

// TestScheduleHoldsForFirstReads: just after the start, while a mount waits
// for its first snapshot, only changes start — setups, adoptions and
// verifications wait, and a pass is asked for at the end of the wait. They
// start once no mount waits from a source that has not failed and the
// changes are written, or once firstReadsWait has passed.
func TestScheduleHoldsForFirstReads(t *testing.T) {
	for _, release := range []string{"read", "source failed", "timeout"} {
		t.Run(release, func(t *testing.T) {
			r := scheduler()
			now := time.Now()
			r.startedAt = now
			dsw := DesiredState{
				"new":     desired(1, "v"),
				"adopt":   desired(1, "v"),
				"verify":  desired(1, "v"),
				"changed": desired(2, "new"),
				"waiting": {Spec: &config.Mount{}, Waiting: []string{"main"}},
			}
			r.asw.Mounts["adopt"] = &ActualMount{}
			r.asw.Mounts["verify"] = &ActualMount{Generation: 1}
			r.asw.Mounts["changed"] = &ActualMount{Generation: 1}
			ops := func() []Op {
				return []Op{{Kind: Remount, Mount: "adopt"}, {Kind: Setup, Mount: "new"}, {Kind: Verify, Mount: "verify"}}
			}
			start, at := r.schedule(append(ops(), Op{Kind: Remount, Mount: "changed"}), dsw, now.Add(time.Second))
			if len(start) != 1 || start[0].Mount != "changed" || !at.Equal(now.Add(firstReadsWait)) {
				t.Fatalf("started %v, next pass at %v; want only the change, and a pass at %v", start, at.Sub(now), firstReadsWait)
			}
			later := now.Add(2 * time.Second)
			switch release {
			case "read":
				dsw["waiting"] = desired(1, "v")
			case "source failed":
				dsw["waiting"].Stale = []error{errors.New("unreachable")}
			case "timeout":
				later = now.Add(firstReadsWait)
			}
			if release != "timeout" {
				start, at = r.schedule(ops(), dsw, later)
				if len(start) != 0 || !at.Equal(now.Add(firstReadsWait)) {
					t.Fatalf("started %v, next pass at %v while the change is written; want none, and a pass at %v", start, at.Sub(now), firstReadsWait)
				}
				r.finished("changed", time.Millisecond, later)
			}
			start, _ = r.schedule(ops(), dsw, later)
			if got := started(start); !got["new"] || !got["adopt"] || !got["verify"] {
				t.Errorf("started %v after the first reads; want new, adopt and verify", start)
			}
		})
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
		r.asw.Mounts[name] = &ActualMount{} // adoptions
		bulk = append(bulk, Op{Kind: Remount, Mount: name})
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

// TestPassPace checks the pace of the loop's passes: while the first
// reads are held for, the next wake-up from the populator waits four
// times the last pass's duration, at most maxPassPace; after them, none.
func TestPassPace(t *testing.T) {
	r := &Reconciler{}
	for _, c := range []struct{ took, want time.Duration }{
		{0, 0},
		{200 * time.Microsecond, 800 * time.Microsecond},
		{time.Millisecond, 4 * time.Millisecond},
		{time.Second, maxPassPace},
	} {
		if got := r.passPace(c.took); got != c.want {
			t.Errorf("before the first reads are done, a pass of %v: next wake-up after %v; want %v", c.took, got, c.want)
		}
	}
	r.readsDone = true
	if got := r.passPace(time.Second); got != 0 {
		t.Errorf("after the first reads, a pass of 1s: next wake-up after %v; want at once", got)
	}
}
