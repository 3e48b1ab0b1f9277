package reconcile

import (
	"log/slog"
	"os"
	goruntime "runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// BulkProcs is the number of Go scheduler Ps (runtime.GOMAXPROCS) kvmount
// runs with while it sets up mounts in bulk: while more than MaxOperations
// setups run at once (a cold start, a reload that adds many mounts).
//
// A setup is a long run of file system calls that block: an fsync for
// every file, and on a busy disk a create or a symlink waits too, for the
// buffers the fsyncs hold. A goroutine in a blocking system call keeps its P
// until the runtime's monitor thread takes it back, 20 µs to 10 ms later,
// and hands it to another thread (golang/go#18236). With the default of one
// P per CPU, 512 setups on two CPUs spend most of their time waiting for a P
// rather than for the disk. Measured with 1,000 new mounts of 100 files on
// two CPUs (BENCHMARKS.md, "Restart at scale"): a cold start took 17.0–22.6 s
// with 2 Ps and 9.3–12.6 s with 32 in the benchmark; black-box, one run
// each, 8, 16, 64 and 128 Ps did no better than 32. CPU time does not grow:
// the threads wait for the disk either way.
//
// Once no setup runs, GOMAXPROCS returns to the runtime's default
// (runtime.SetDefaultGOMAXPROCS) and the threads the bulk left are ended
// (shedThreads). A GOMAXPROCS set in the environment is the operator's: it
// is never changed.
const BulkProcs = 32

// procs raises GOMAXPROCS to BulkProcs for bulk setups and restores the
// default, and the number of threads, afterwards.
type procs struct {
	log *slog.Logger
	// fixed: GOMAXPROCS comes from the environment and is left alone.
	fixed bool
	// raised: GOMAXPROCS is BulkProcs, set by fit.
	raised bool
	// threads is how many threads the process had when raised.
	threads int
	// set, restore and shed are runtime.GOMAXPROCS,
	// runtime.SetDefaultGOMAXPROCS and shedThreads; tests replace them.
	set     func(n int) int
	restore func()
	shed    func(keep int)
}

func newProcs(log *slog.Logger) *procs {
	return &procs{
		log:     log,
		fixed:   os.Getenv("GOMAXPROCS") != "",
		set:     goruntime.GOMAXPROCS,
		restore: goruntime.SetDefaultGOMAXPROCS,
		shed:    func(keep int) { shedThreads(keep, log) },
	}
}

// fit adjusts GOMAXPROCS to setups, the number of setups running: raised
// to BulkProcs when more than MaxOperations run and the current setting is
// lower; back to the default when none runs, and then the threads beyond
// those the process had before are ended in the background.
func (p *procs) fit(setups int) {
	switch {
	case p.fixed:
	case !p.raised && setups > MaxOperations:
		if was := p.set(0); was < BulkProcs {
			p.threads = threadCount()
			p.set(BulkProcs)
			p.raised = true
			p.log.Debug("setups in bulk: GOMAXPROCS raised", "setups", setups, "from", was, "to", BulkProcs)
		}
	case p.raised && setups == 0:
		p.restore()
		p.raised = false
		go p.shed(p.threads)
		p.log.Debug("bulk setups done: GOMAXPROCS back to the default", "gomaxprocs", p.set(0))
	}
}

// threadCount returns how many threads the process has (the entries of
// /proc/self/task), or 0 if that cannot be read.
func threadCount() int {
	entries, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return 0
	}
	return len(entries)
}

// shedThreads ends the threads beyond keep that the process has, then
// returns the memory they and the bulk freed to the system
// (ReleaseMemory).
//
// The runtime never ends an idle thread, and bulk setups leave a few
// hundred behind, each with its stacks (tens of KiB): about 9 MB of RSS at
// rest with 100,000 keys (black-box, BENCHMARKS.md). A goroutine that exits while locked to its
// thread (runtime.LockOSThread) ends that thread instead: so shedThreads
// parks one locked goroutine per thread to end — each takes an idle thread,
// or a new one when none is left — and then lets them all exit, in up to
// three rounds.
//
// An ended thread's record (its m) and, in a static build, its system
// goroutine's stack of 16 KiB are freed only when the runtime next makes
// a thread (allocm frees the list of ended threads, sched.freem, in
// runtime/proc.go), which at rest may never come: 2,000 threads ended so
// held 22 MB of RSS, measured (BENCHMARKS.md, "The monitor's heap after
// a cold start"). So a last round parks one goroutine more than the
// process has threads, which makes it make one: the threads that round
// ends, a handful, wait in turn for the next.
func shedThreads(keep int, log *slog.Logger) {
	if keep <= 0 {
		return
	}
	from := threadCount()
	// A parked goroutine's P goes to another thread, a new one when none
	// is idle: a round can leave some behind, so up to three.
	for range 3 {
		n := threadCount() - keep
		if n <= 0 {
			break
		}
		endThreads(n)
	}
	if from > keep {
		endThreads(threadCount() + 1)
	}
	ReleaseMemory()
	log.Debug("threads left by bulk setups ended", "threads", from, "now", threadCount())
}

// endThreads ends up to n threads: it parks n goroutines, each locked to
// a thread of its own (an idle one, or a new one when none is left), and
// lets them exit together.
func endThreads(n int) {
	var locked, exited sync.WaitGroup
	release := make(chan struct{})
	for range n {
		locked.Add(1)
		exited.Add(1)
		go func() {
			defer exited.Done()
			goruntime.LockOSThread()
			locked.Done()
			<-release
		}()
	}
	locked.Wait()
	close(release)
	exited.Wait()
}

// maxShrinkCollections bounds the collections ReleaseMemory runs to
// shrink goroutine stacks: each halves a stack, so eight take one of
// 512 KiB back to the runtime's 2 KiB minimum.
const maxShrinkCollections = 8

// ReleaseMemory returns to the system the heap and the goroutine stacks
// that a burst of work grew and no longer uses: it collects until the
// stacks stop shrinking, at most maxShrinkCollections times, then returns
// the free heap (debug.FreeOSMemory, one more collection).
//
// A collection halves the stack of a goroutine that uses less than a
// quarter of it, never more (Go's runtime, shrinkstack in
// runtime/stack.go), so one collection leaves a stack that a burst grew
// to 64 KiB at 32 KiB. Measured after a cold start of 1,000 mounts, the
// monitor's 62 goroutines held 3.4 MB of stacks after its release and
// 1.5 MB after the collections of the next burst (BENCHMARKS.md, "The
// monitor's heap after a cold start"). A collection of a heap of tens of
// megabytes costs milliseconds of CPU, once per burst.
func ReleaseMemory() {
	last := stackBytes()
	for range maxShrinkCollections {
		goruntime.GC()
		now := stackBytes()
		if now >= last {
			break
		}
		last = now
	}
	debug.FreeOSMemory()
}

// stackBytes returns the memory of the heap's spans that hold goroutine
// stacks, in bytes (runtime/metrics' /memory/classes/heap/stacks:bytes).
func stackBytes() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/stacks:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}
