package reconcile

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
)

// reconcilerRun is a Reconciler running over a fake cache and real
// directories, with the status of every pass recorded.
type reconcilerRun struct {
	t       *testing.T
	cache   *fakeCache
	trigger Trigger
	rec     *Reconciler
	base    string

	mu     sync.Mutex
	status map[string]MountStatus
	// onPass, when set, is called with every pass's status of each mount.
	onPass func(MountStatus)
	// reports holds the time of every PassEvent.
	reports []time.Time
	// stop ends the run and waits for it (also at the test's end).
	stop func()
}

// watchPasses calls f with every later pass's status of each mount.
func (r *reconcilerRun) watchPasses(f func(MountStatus)) {
	r.mu.Lock()
	r.onPass = f
	r.mu.Unlock()
}

func startReconciler(t *testing.T, mounts ...*config.Mount) *reconcilerRun {
	t.Helper()
	return startReconcilerWith(t, nil, time.Hour, mounts...)
}

// startReconcilerWith is startReconciler with the populator wrapped by
// wrap (when not nil) and a resync every resync.
func startReconcilerWith(t *testing.T, wrap func(*Populator) Desired, resync time.Duration, mounts ...*config.Mount) *reconcilerRun {
	t.Helper()
	return startReconcilerIn(t, t.TempDir(), wrap, resync, mounts...)
}

// startReconcilerIn is startReconcilerWith over base, which may hold what
// an earlier run (stopped) left: a restart.
func startReconcilerIn(t *testing.T, base string, wrap func(*Populator) Desired, resync time.Duration, mounts ...*config.Mount) *reconcilerRun {
	t.Helper()
	owned, err := LoadOwned(filepath.Join(base, "state"))
	if err != nil {
		t.Fatal(err)
	}
	r := &reconcilerRun{t: t, cache: newFakeCache(), trigger: NewTrigger(), base: base, status: map[string]MountStatus{}}
	for _, m := range mounts {
		m.Dir = filepath.Join(base, "mnt", m.Name)
	}
	var pop Desired = NewPopulatorFor(r.cache, discard)
	if wrap != nil {
		pop = wrap(pop.(*Populator))
	}
	if err := pop.SetMounts(mounts); err != nil {
		t.Fatal(err)
	}
	r.rec = New(pop, owned, r.trigger, discard, Options{ResyncInterval: resync, Observer: ObserverFunc(func(ev Event) {
		pass, ok := ev.(PassEvent)
		if !ok {
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		r.reports = append(r.reports, pass.Time)
		r.status = map[string]MountStatus{}
		for _, s := range pass.Mounts {
			r.status[s.Name] = s
			if r.onPass != nil {
				r.onPass(s)
			}
		}
	})})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.rec.Run(ctx) }()
	var once sync.Once
	r.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Run = %v", err)
			}
		})
	}
	t.Cleanup(r.stop)
	return r
}

// publish sets a feed's snapshot and wakes the reconciler.
func (r *reconcilerRun) publish(prefix string, entries map[string]string) {
	r.cache.feed("main", prefix).publish("r", entries)
	r.trigger.Fire()
}

// wait waits until the status of mount satisfies cond.
func (r *reconcilerRun) wait(mount, what string, cond func(MountStatus) bool) {
	r.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		r.mu.Lock()
		st, ok := r.status[mount]
		r.mu.Unlock()
		if ok && cond(st) {
			return
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("mount %s: never %s; last status %+v", mount, what, st)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func projected(st MountStatus) bool { return st.Projected }

func (r *reconcilerRun) read(mount, path string) string {
	data, _ := os.ReadFile(filepath.Join(r.base, "mnt", mount, path))
	return string(data)
}

// TestReconcilerFailureStaysWithItsMount: one mount whose directory holds
// foreign files fails and backs off; the other is projected and follows
// its changes; a reload that removes the failing mount settles everything.
func TestReconcilerFailureStaysWithItsMount(t *testing.T) {
	good, bad := testMount("good", "/g/"), testMount("bad", "/b/")
	r := startReconciler(t, good, bad)
	if err := os.MkdirAll(bad.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bad.Dir, "theirs"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	r.publish("/g/", map[string]string{"a": "1"})
	r.publish("/b/", map[string]string{"a": "1"})
	r.wait("good", "projected", projected)
	r.wait("bad", "failed", func(st MountStatus) bool { return st.Err != nil && strings.Contains(st.Err.Error(), "did not write") })
	for i := 2; i <= 4; i++ {
		v := string(rune('0' + i))
		r.publish("/g/", map[string]string{"a": v})
		r.wait("good", "updated", func(st MountStatus) bool { return st.Projected && r.read("good", "a") == v })
	}
	if err := r.rec.Reload(context.Background(), ReloadConfig{Mounts: []*config.Mount{good}}); err != nil {
		t.Fatal(err)
	}
	r.wait("good", "still projected", projected)
	if got := r.read("bad", "theirs"); got != "x" {
		t.Errorf("the foreign file of the failed mount = %q; want it untouched", got)
	}
}

// TestReconcilerTearsDownRemovedMounts: a mount removed by a reload is torn
// down — its files and the directory kvmount created are gone.
func TestReconcilerTearsDownRemovedMounts(t *testing.T) {
	keep, gone := testMount("keep", "/k/"), testMount("gone", "/x/")
	r := startReconciler(t, keep, gone)
	r.publish("/k/", map[string]string{"a": "1"})
	r.publish("/x/", map[string]string{"b": "2"})
	r.wait("gone", "projected", projected)
	r.wait("keep", "projected", projected)
	if err := r.rec.Reload(context.Background(), ReloadConfig{Mounts: []*config.Mount{keep}}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := os.Lstat(gone.Dir); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still exists after its mount was removed", gone.Dir)
		}
		time.Sleep(2 * time.Millisecond)
	}
	if got := r.read("keep", "a"); got != "1" {
		t.Errorf("kept mount holds %q", got)
	}
}

// TestStatusReportedAtMostEvery: a burst of updates of one mount, each
// followed by passes a few milliseconds apart, reports every mount's
// status at most every statusEvery; and the status of the pass after the
// last write, held back for that, is reported at the end of the interval.
func TestStatusReportedAtMostEvery(t *testing.T) {
	r := startReconciler(t, testMount("m", "/m/"))
	r.publish("/m/", map[string]string{"a": "0"})
	r.wait("m", "projected", projected)
	const updates = 100
	for i := 1; i <= updates; i++ {
		r.publish("/m/", map[string]string{"a": strconv.Itoa(i)})
		time.Sleep(2 * time.Millisecond)
	}
	deadline := time.Now().Add(30 * time.Second)
	for r.read("m", "a") != strconv.Itoa(updates) {
		if time.Now().After(deadline) {
			t.Fatal("the last update was never written")
		}
		time.Sleep(time.Millisecond)
	}
	written := time.Now()
	// A pass follows the last write's result; its status must be
	// reported, at the latest statusEvery after the report before it.
	for {
		r.mu.Lock()
		last := r.reports[len(r.reports)-1]
		r.mu.Unlock()
		if last.After(written.Add(-5 * time.Millisecond)) {
			break
		}
		if time.Since(written) > statusEvery+time.Second {
			t.Fatalf("no status reported since the last write, %v ago", time.Since(written))
		}
		time.Sleep(time.Millisecond)
	}
	r.wait("m", "projected after the burst", projected)
	r.mu.Lock()
	defer r.mu.Unlock()
	// Each update is written, and a pass follows each write's result:
	// reported one by one, they would be at least as many.
	if len(r.reports) > updates/4 {
		t.Fatalf("%d status reports for %d updates; want them paced", len(r.reports), updates)
	}
	for i := 1; i < len(r.reports); i++ {
		if gap := r.reports[i].Sub(r.reports[i-1]); gap < statusEvery {
			t.Fatalf("status reports %d and %d of %d came %v apart; want at least %v", i, i+1, len(r.reports), gap, statusEvery)
		}
	}
	t.Logf("%d status reports for %d updates", len(r.reports), updates)
}

// TestUnreportedStatusReportedAtEnd: a pass that leaves its status for
// later (statusEvery) has it reported when Run ends before another pass.
func TestUnreportedStatusReportedAtEnd(t *testing.T) {
	cache := newFakeCache()
	pop := NewPopulatorFor(cache, discard)
	if err := pop.SetMounts([]*config.Mount{testMount("m", "/m/")}); err != nil {
		t.Fatal(err)
	}
	owned, err := LoadOwned(filepath.Join(t.TempDir(), "state"))
	if err != nil {
		t.Fatal(err)
	}
	var reports []PassEvent
	r := New(pop, owned, NewTrigger(), discard, Options{Observer: ObserverFunc(func(ev Event) {
		if pass, ok := ev.(PassEvent); ok {
			reports = append(reports, pass)
		}
	})})
	now := time.Now()
	r.pass(now)
	if retry := r.pass(now.Add(time.Millisecond)); !retry.Equal(now.Add(statusEvery)) {
		t.Errorf("the pass that left its status for later is due again at %v; want %v", retry, now.Add(statusEvery))
	}
	if len(reports) != 1 {
		t.Fatalf("%d reports after two passes 1 ms apart; want 1", len(reports))
	}
	r.reportUnreported()
	if len(reports) != 2 || len(reports[1].Mounts) != 1 || reports[1].Mounts[0].Name != "m" {
		t.Fatalf("reports after the end: %+v; want a second with mount m", reports)
	}
	r.reportUnreported()
	if len(reports) != 2 {
		t.Errorf("%d reports after a second end; want nothing more", len(reports))
	}
}

// TestCollectionKeepsAMountProjected: the collection of a replaced
// version (keep_replaced after a change) and a verification run on a
// mount that holds its desired payload; no pass reports it as anything
// but projected meanwhile (/readyz answered 503 for a moment at each
// collection).
func TestCollectionKeepsAMountProjected(t *testing.T) {
	m := testMount("m", "/m/", func(m *config.Mount) { m.KeepReplaced = 50 * time.Millisecond })
	r := startReconciler(t, m)
	var mu sync.Mutex
	var seen []bool
	r.publish("/m/", map[string]string{"a": "1"})
	r.wait("m", "projected", projected)
	r.publish("/m/", map[string]string{"a": "2"})
	r.wait("m", "updated", func(st MountStatus) bool { return st.Projected && r.read("m", "a") == "2" })
	r.watchPasses(func(st MountStatus) {
		mu.Lock()
		seen = append(seen, st.Projected)
		mu.Unlock()
	})
	// The replaced version goes 50 ms after the switch.
	deadline := time.Now().Add(30 * time.Second)
	for versions(t, m.Dir) > 1 {
		if time.Now().After(deadline) {
			t.Fatal("the replaced version was never collected")
		}
		time.Sleep(5 * time.Millisecond)
	}
	r.trigger.Fire()
	time.Sleep(100 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(seen) == 0 {
		t.Fatal("no pass seen")
	}
	for i, p := range seen {
		if !p {
			t.Fatalf("pass %d of %d reported the mount not projected during its collection", i+1, len(seen))
		}
	}
}

// versions returns how many version directories dir holds.
func versions(t *testing.T, dir string) int {
	t.Helper()
	list, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range list {
		if e.IsDir() && strings.HasPrefix(e.Name(), "..") {
			n++
		}
	}
	return n
}

// TestReloadSwapsTwoMountsDirectories: a reload that swaps the directories
// of two projected mounts tears both down and sets each up in the other's
// old directory once that one's teardown has left it — a setup that waits
// for another mount is planned again on every pass until it starts
// (changes.go). The passes check their plans against plans of every mount
// (verifyPlans).
func TestReloadSwapsTwoMountsDirectories(t *testing.T) {
	a, b := testMount("a", "/a/"), testMount("b", "/b/")
	r := startReconciler(t, a, b)
	r.publish("/a/", map[string]string{"key": "of a"})
	r.publish("/b/", map[string]string{"key": "of b"})
	r.wait("a", "projected", projected)
	r.wait("b", "projected", projected)
	a2, b2 := *a, *b
	a2.Dir, b2.Dir = b.Dir, a.Dir
	if err := r.rec.Reload(context.Background(), ReloadConfig{Mounts: []*config.Mount{&a2, &b2}}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for r.read("b", "key") != "of a" || r.read("a", "key") != "of b" {
		if time.Now().After(deadline) {
			t.Fatalf("after the swap, %s holds %q and %s %q; want each the other's mount", a.Dir, r.read("a", "key"), b.Dir, r.read("b", "key"))
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestSetupsHeldForTheFirstReads: the mounts whose snapshots came first
// are not set up while another still waits for its first one
// (schedule.go), and all are set up once it comes — their setups,
// planned and held on the passes before, planned again on every pass
// until they start (changes.go). With one, a pass that planned every
// mount leaves it to the next; with 100, the passes plan every mount
// while many are held (bulk). Every pass is checked against a plan of
// every mount.
func TestSetupsHeldForTheFirstReads(t *testing.T) {
	for _, early := range []int{1, 100} {
		t.Run(fmt.Sprintf("early=%d", early), func(t *testing.T) { setupsHeldForTheFirstReads(t, early) })
	}
}

func setupsHeldForTheFirstReads(t *testing.T, early int) {
	var mounts []*config.Mount
	for i := range early {
		mounts = append(mounts, testMount(fmt.Sprintf("early%03d", i), fmt.Sprintf("/e%03d/", i)))
	}
	late := testMount("late", "/l/")
	r := startReconciler(t, append(mounts, late)...)
	for i := range early {
		r.publish(fmt.Sprintf("/e%03d/", i), map[string]string{"key": "early"})
	}
	last := mounts[early-1].Name
	r.wait(last, "held for the first reads", func(st MountStatus) bool { return !st.Projected && len(st.Waiting) == 0 })
	time.Sleep(50 * time.Millisecond)
	if got := r.read("early000", "key"); got != "" {
		t.Fatalf("early000 holds %q while late waits for its first snapshot; want nothing yet", got)
	}
	r.publish("/l/", map[string]string{"key": "late"})
	for _, m := range mounts {
		r.wait(m.Name, "projected", projected)
	}
	r.wait("late", "projected", projected)
}
