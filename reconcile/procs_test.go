package reconcile

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	goruntime "runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeProcs returns procs whose GOMAXPROCS starts at n and is only
// recorded, and a pointer to that setting.
func fakeProcs(n int) (*procs, *int) {
	current := n
	return &procs{
		log: slog.New(slog.DiscardHandler),
		set: func(m int) int {
			was := current
			if m > 0 {
				current = m
			}
			return was
		},
		restore: func() { current = n },
		shed:    func(int) {},
	}, &current
}

// TestProcsFit raises GOMAXPROCS only for more than MaxOperations setups,
// keeps it raised while any setup runs and restores the default once none
// does.
func TestProcsFit(t *testing.T) {
	p, current := fakeProcs(2)
	steps := []struct {
		setups int
		want   int
	}{
		{0, 2},
		{MaxOperations, 2}, // a few setups: not bulk
		{MaxOperations + 1, BulkProcs},
		{512, BulkProcs},
		{1, BulkProcs}, // the last ones of the bulk
		{0, 2},
		{MaxOperations, 2},
	}
	for i, s := range steps {
		p.fit(s.setups)
		if *current != s.want {
			t.Fatalf("step %d (%d setups): GOMAXPROCS %d, want %d", i, s.setups, *current, s.want)
		}
	}
}

// TestProcsFitLeavesAlone changes nothing when GOMAXPROCS comes from the
// environment or is already at least BulkProcs (a large host).
func TestProcsFitLeavesAlone(t *testing.T) {
	fixed, current := fakeProcs(2)
	fixed.fixed = true
	for _, setups := range []int{512, 0} {
		fixed.fit(setups)
		if *current != 2 {
			t.Fatalf("GOMAXPROCS from the environment changed to %d", *current)
		}
	}
	large, current := fakeProcs(64)
	for _, setups := range []int{512, 0} {
		large.fit(setups)
		if *current != 64 {
			t.Fatalf("GOMAXPROCS 64 changed to %d", *current)
		}
	}
}

// TestProcsFitRuntime raises and restores the runtime's own setting.
func TestProcsFitRuntime(t *testing.T) {
	if goruntime.GOMAXPROCS(0) >= BulkProcs {
		t.Fatalf("this test needs fewer than %d CPUs (GOMAXPROCS %d)", BulkProcs, goruntime.GOMAXPROCS(0))
	}
	p := newProcs(slog.New(slog.DiscardHandler))
	p.fixed = false // whatever the test runner's environment says
	p.shed = func(int) {}
	before := goruntime.GOMAXPROCS(0)
	defer goruntime.GOMAXPROCS(before)
	p.fit(512)
	if got := goruntime.GOMAXPROCS(0); got != BulkProcs {
		t.Fatalf("GOMAXPROCS %d during bulk setups, want %d", got, BulkProcs)
	}
	p.fit(0)
	got := goruntime.GOMAXPROCS(0)
	goruntime.SetDefaultGOMAXPROCS()
	if want := goruntime.GOMAXPROCS(0); got != want {
		t.Fatalf("GOMAXPROCS %d after the bulk, want the default %d", got, want)
	}
}

// TestShedThreads makes the process hold 40 more threads, as bulk setups
// leave them (idle, after a burst of blocking system calls), and ends them.
func TestShedThreads(t *testing.T) {
	before := threadCount()
	if before == 0 {
		t.Fatal("cannot count threads in /proc/self/task")
	}
	var busy, parked sync.WaitGroup
	release := make(chan struct{})
	for range 40 {
		busy.Add(1)
		parked.Add(1)
		go func() {
			defer parked.Done()
			goruntime.LockOSThread() // a thread of its own while parked
			busy.Done()
			<-release
			goruntime.UnlockOSThread() // the thread stays, idle
		}()
	}
	busy.Wait()
	close(release)
	parked.Wait()
	peak := threadCount()
	if peak < 40 {
		t.Fatalf("%d threads after parking 40 goroutines on threads of their own", peak)
	}
	shedThreads(before, slog.New(slog.DiscardHandler))
	// A few threads come and go with the runtime's and the race
	// detector's own work, more on a loaded machine (12 of 46 were seen
	// left with -race beside other packages' tests): most must end.
	if got := threadCount(); got > before+max(5, (peak-before)/4) {
		t.Fatalf("%d threads after shedding from %d down to %d", got, peak, before)
	}
}

// deepStack recurses depth times with a frame of about 1 KiB each, so
// that the goroutine's stack grows to hold it, then waits for release.
func deepStack(depth int, release <-chan struct{}) byte {
	var frame [1024]byte
	frame[depth%len(frame)] = byte(depth)
	if depth == 0 {
		<-release
		return frame[0]
	}
	return deepStack(depth-1, release) + frame[depth%len(frame)]
}

// TestReleaseMemoryShrinksStacks: goroutines whose stacks a burst grew to
// 128 KiB and that now wait with shallow stacks are given back
// most of it by ReleaseMemory, where one collection — what
// debug.FreeOSMemory alone runs — halves each stack at most.
func TestReleaseMemoryShrinksStacks(t *testing.T) {
	const goroutines = 64
	release := make(chan struct{})
	grown := make(chan struct{})
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			// Grow the stack, return from the depth, then wait shallow.
			deepStack(100, grown)
			<-release
		})
	}
	close(grown)
	time.Sleep(50 * time.Millisecond) // every goroutine back at <-release
	debug.FreeOSMemory()
	once := stackBytes()
	ReleaseMemory()
	after := stackBytes()
	close(release)
	wg.Wait()
	t.Logf("heap stacks after one collection %d KiB, after ReleaseMemory %d KiB", once>>10, after>>10)
	if after > once/4 {
		t.Errorf("ReleaseMemory left %d KiB of stacks of %d KiB after one collection; want at most a quarter", after>>10, once>>10)
	}
}

// heapBytes returns the bytes of live and unswept heap objects after a
// collection, and of the heap's goroutine stacks (runtime/metrics).
func heapBytes() uint64 {
	goruntime.GC()
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/memory/classes/heap/stacks:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64() + s[1].Value.Uint64()
}

// staticHelperEnv marks a run of this package's tests in a static build
// (runStatic).
const staticHelperEnv = "KVMOUNT_RECONCILE_STATIC_TEST"

// runStatic runs the test named name in a static build of this package's
// tests (CGO_ENABLED=0, no race detector), as the packages ship kvmount,
// and fails t with its output if it fails. It reports whether the caller
// is that run, and should test; false: it was run, and the caller returns.
func runStatic(t *testing.T, name string) bool {
	t.Helper()
	if os.Getenv(staticHelperEnv) != "" {
		return true
	}
	bin := filepath.Join(t.TempDir(), "reconcile.test")
	build := exec.Command("go", "test", "-c", "-race=false", "-trimpath", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building this package's tests statically: %v\n%s", err, out)
	}
	run := exec.Command(bin, "-test.run", "^"+name+"$", "-test.v", "-test.count", "1")
	run.Env = append(os.Environ(), staticHelperEnv+"=1")
	out, err := run.CombinedOutput()
	t.Logf("%s in a static build:\n%s", name, out)
	if err != nil {
		t.Fatalf("%s in a static build: %v", name, err)
	}
	return false
}

// TestShedThreadsFreesTheirRecords: the threads shedThreads ends give
// back their records — the runtime's m and, in a static build, its
// system goroutine's stack of 16 KiB from the heap — which the runtime
// frees only when it next makes a thread. It runs in a static build (in
// a cgo build, as the race detector makes, those stacks are the C
// library's): 300 ended threads held 7–8 MB of heap there without the
// last round that makes one, and 1.3 MB with it (of goroutines' records,
// which the runtime keeps).
func TestShedThreadsFreesTheirRecords(t *testing.T) {
	if !runStatic(t, "TestShedThreadsFreesTheirRecords") {
		return
	}
	before := threadCount()
	base := heapBytes()
	// As bulk setups make them: blocking system calls at BulkProcs Ps,
	// each of which hands its P to another thread.
	was := goruntime.GOMAXPROCS(BulkProcs)
	var wg sync.WaitGroup
	for range 300 {
		wg.Go(func() {
			ts := unix.Timespec{Nsec: int64(100 * time.Millisecond)}
			_ = unix.Nanosleep(&ts, nil)
		})
	}
	wg.Wait()
	goruntime.GOMAXPROCS(was)
	peak := heapBytes()
	// Some threads kept idle, as the daemon keeps those it had before
	// its bulk setups: the runtime has threads for its collections then,
	// and makes none.
	shedThreads(before+8, slog.New(slog.DiscardHandler))
	after := heapBytes()
	t.Logf("heap objects and stacks: %d KiB before, %d KiB with 300 threads more, %d KiB after shedding them", base>>10, peak>>10, after>>10)
	if after > base+3<<20 {
		t.Errorf("%d KiB more heap after the threads were ended than before they were made; want at most 3 MiB", (after-base)>>10)
	}
}
