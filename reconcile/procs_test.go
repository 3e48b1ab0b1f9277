package reconcile

import (
	"log/slog"
	goruntime "runtime"
	"runtime/debug"
	"sync"
	"testing"
	"time"
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
