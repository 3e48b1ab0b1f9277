package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
)

// TestHeapReleaseAfterBursts: the heap is released once a burst of
// switches is over, not after fewer switches, not for writes that changed
// nothing, and not while the burst goes on.
func TestHeapReleaseAfterBursts(t *testing.T) {
	var released atomic.Int32
	h := &heapRelease{quiet: time.Second, release: func() error { released.Add(1); return nil }}
	t.Cleanup(h.stop)
	switched := reconcile.ProjectedEvent{Mount: "m", Change: projector.Change{Changed: []string{"f"}}}
	unchanged := reconcile.ProjectedEvent{Mount: "m"}

	for range burstWrites - 1 {
		h.Observe(switched)
	}
	for range 10 * burstWrites {
		h.Observe(unchanged)
	}
	h.Observe(reconcile.PassEvent{})
	time.Sleep(h.quiet * 3 / 2)
	if n := released.Load(); n != 0 {
		t.Fatalf("released %d times after %d switches; want none before %d", n, burstWrites-1, burstWrites)
	}

	// The burst's last switch, then more for twice the quiet time: each
	// puts the release off.
	h.Observe(switched)
	for range 20 {
		time.Sleep(h.quiet / 10)
		h.Observe(switched)
	}
	if n := released.Load(); n != 0 {
		t.Fatalf("released %d times while the burst went on; want none", n)
	}
	for deadline := time.Now().Add(10 * time.Second); released.Load() == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the heap was never released after the burst")
		}
	}
	time.Sleep(h.quiet * 3 / 2)
	if n := released.Load(); n != 1 {
		t.Fatalf("released %d times after one burst; want 1", n)
	}

	// The count starts again: a few switches later, nothing more.
	for range burstWrites / 2 {
		h.Observe(switched)
	}
	time.Sleep(h.quiet * 3 / 2)
	if n := released.Load(); n != 1 {
		t.Fatalf("released %d times; want 1 (half a burst since)", n)
	}

	// Payloads taken from a worker count as switches do: a burst of
	// them, as a worker started again sends, is released too.
	for range burstWrites {
		h.Payload()
	}
	for deadline := time.Now().Add(10 * time.Second); released.Load() == 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the heap was never released after a burst of payloads")
		}
	}
}

// TestHeapReleasedAfterWorkerResend runs the daemon with a real worker and
// more mounts than a burst: after the cold start's burst the monitor gives
// its heap back. A worker killed and started again is given the digest of
// what each mount holds (privsep.OnDisk) and sends its payloads, equal to
// the ones projected, as Unchanged: none crosses whole, so the monitor
// takes no burst of payloads to give back (before, it took every one and
// gave the heap back after them), and the mounts stay current. The new
// worker gives its own heap back after the burst it built.
func TestHeapReleasedAfterWorkerResend(t *testing.T) {
	h := newHarness(t)
	h.heapQuiet = time.Second // the monitor's; the worker's is burstQuiet
	var mounts strings.Builder
	const n = burstWrites + 6
	for i := range n {
		h.put(fmt.Sprintf("/apps/m%02d/app.conf", i), "v1")
		mounts.WriteString(h.mount(fmt.Sprintf("m%02d", i), fmt.Sprintf("/apps/m%02d/", i)))
	}
	h.writeConfig(mounts.String())
	h.start()
	last := h.path("mnt", fmt.Sprintf("m%02d", n-1))
	h.waitContent(last, map[string]string{"app.conf": "v1"})
	const released = "returned the free heap memory to the system after a burst"
	byMonitor := func() int { return h.logs.Count(released) - h.logs.Count(released, "from=worker") }
	h.waitLog(released)
	time.Sleep(2 * h.heapQuiet)
	if n := byMonitor(); n != 1 {
		t.Fatalf("%d releases by the monitor after the cold start; want 1", n)
	}
	pid, _ := strconv.Atoi(workerPID(t, h, 1))
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if n := h.logs.Count(released, "from=worker"); n != 0 {
		t.Fatalf("the first worker released its heap %d times within burstQuiet of its payloads", n)
	}
	second := workerPID(t, h, 2)
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(20 * time.Millisecond) {
		w := workerStatus(t, h)
		if w.Unchanged == n {
			if w.Payloads != n {
				t.Errorf("%d payloads taken whole; want %d, the cold start's alone", w.Payloads, n)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the new worker sent %d payloads as Unchanged and %d whole in all; want %d Unchanged", w.Unchanged, w.Payloads, n)
		}
	}
	h.waitContent(last, map[string]string{"app.conf": "v1"})
	h.put(fmt.Sprintf("/apps/m%02d/app.conf", n-1), "v2")
	h.waitContent(last, map[string]string{"app.conf": "v2"})
	// The new worker's own release, burstQuiet after its payloads (the
	// first was killed before its own).
	for deadline := time.Now().Add(burstQuiet + waitTimeout); h.logs.Count(released, "from=worker") == 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("worker %s did not release its heap after sending its payloads", second)
		}
	}
}

// TestExecutablePagesReleased: after its first projection the monitor,
// and after its first payloads the worker — confined, its seccomp filter
// and Landlock ruleset in force — return their heap and unmap their
// executable's pages (exepages) without an error, and the worker goes on
// serving updates from the code it maps again.
func TestExecutablePagesReleased(t *testing.T) {
	h := newHarness(t)
	h.put("/apps/web/app.conf", "v1")
	h.writeConfig(h.mount("web", "/apps/web/"))
	h.start()
	h.waitContent(h.path("mnt", "web"), map[string]string{"app.conf": "v1"})
	h.waitLog("returned the free heap memory to the system after the first projection")
	h.waitLog("returned the free heap memory to the system after the first payloads", "from=worker")
	h.put("/apps/web/app.conf", "v2")
	h.waitContent(h.path("mnt", "web"), map[string]string{"app.conf": "v2"})
	if n := h.logs.Count("the executable's pages stay mapped"); n != 0 {
		t.Fatalf("%d failures to unmap the executable's pages:\n%s", n, h.logs.String())
	}
}

// TestExecutablePagesDroppedAtRest: after its first release, a process
// unmaps its executable's pages again after a collection of the Go
// runtime, once it has been quiet for burstQuiet — not before its first
// release, not within restEvery of the last drop, not while switches or
// payloads come, and not after stop.
func TestExecutablePagesDroppedAtRest(t *testing.T) {
	var drops atomic.Int32
	h := &heapRelease{quiet: time.Second, restEvery: 200 * time.Millisecond, drop: func() error { drops.Add(1); return nil }}
	h.release = h.drop
	h.watchCollections()
	t.Cleanup(h.stop)
	settle := func() { runtime.GC(); time.Sleep(100 * time.Millisecond) }
	want := func(n int32, when string) {
		t.Helper()
		if got := drops.Load(); got != n {
			t.Fatalf("%d drops %s; want %d", got, when, n)
		}
	}

	settle()
	want(0, "before the first release")
	h.now("the test's start")
	for deadline := time.Now().Add(waitTimeout); drops.Load() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the first release never dropped the pages")
		}
	}
	settle()
	want(1, "within restEvery of the first release")

	h.Observe(reconcile.ProjectedEvent{Mount: "m", Change: projector.Change{Changed: []string{"f"}}})
	wrote := time.Now()
	time.Sleep(2 * h.restEvery)
	settle()
	want(1, "after a collection less than quiet after a switch")

	time.Sleep(time.Until(wrote.Add(h.quiet)))
	runtime.GC()
	for deadline := time.Now().Add(waitTimeout); drops.Load() == 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("a collection at rest did not drop the pages")
		}
		runtime.GC()
	}
	want(2, "after a collection at rest")

	h.stop()
	time.Sleep(h.quiet + h.restEvery)
	settle()
	want(2, "after stop")
}

// TestFailedDropAtRestEndsThem: a drop at rest that fails is logged once,
// and no drop at rest follows: it would fail again.
func TestFailedDropAtRestEndsThem(t *testing.T) {
	var drops atomic.Int32
	var logs testlog.Buffer
	h := &heapRelease{
		log:   slog.New(slog.NewTextHandler(&logs, nil)),
		quiet: 50 * time.Millisecond, restEvery: 50 * time.Millisecond,
		drop: func() error { drops.Add(1); return errors.New("smaps unreadable") },
	}
	h.release = h.drop
	h.watchCollections()
	t.Cleanup(h.stop)
	h.now("the test's start")
	for deadline := time.Now().Add(waitTimeout); drops.Load() < 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no drop at rest after the release")
		}
		runtime.GC()
	}
	for range 5 {
		time.Sleep(2 * h.restEvery)
		runtime.GC()
	}
	time.Sleep(100 * time.Millisecond)
	if n := drops.Load(); n != 2 {
		t.Fatalf("%d drops; want 2 (the release's, one at rest)", n)
	}
	if n := logs.Count("the executable's pages stay mapped"); n != 2 {
		t.Fatalf("%d warnings; want 2:\n%s", n, logs.String())
	}
}
