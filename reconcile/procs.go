package reconcile

import (
	"log/slog"
	"os"
	goruntime "runtime"
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
// two CPUs (BENCHMARKS.md, "Restart at scale"): a cold start took 22–27 s
// with 2 Ps and 13–15 s with 32 (8 and 16 were in between, 64 and 128 no
// better). CPU time does not grow: the threads wait for the disk either way.
//
// Once no setup runs, GOMAXPROCS returns to the runtime's default
// (runtime.SetDefaultGOMAXPROCS). A GOMAXPROCS set in the environment is
// the operator's: it is never changed.
const BulkProcs = 32

// procs raises GOMAXPROCS to BulkProcs for bulk setups and restores the
// default afterwards.
type procs struct {
	log *slog.Logger
	// fixed: GOMAXPROCS comes from the environment and is left alone.
	fixed bool
	// raised: GOMAXPROCS is BulkProcs, set by fit.
	raised bool
	// set and restore are runtime.GOMAXPROCS and
	// runtime.SetDefaultGOMAXPROCS; tests replace them.
	set     func(n int) int
	restore func()
}

func newProcs(log *slog.Logger) *procs {
	return &procs{
		log:     log,
		fixed:   os.Getenv("GOMAXPROCS") != "",
		set:     goruntime.GOMAXPROCS,
		restore: goruntime.SetDefaultGOMAXPROCS,
	}
}

// fit adjusts GOMAXPROCS to setups, the number of setups running: raised
// to BulkProcs when more than MaxOperations run and the current setting is
// lower, back to the default when none runs.
func (p *procs) fit(setups int) {
	switch {
	case p.fixed:
	case !p.raised && setups > MaxOperations:
		if was := p.set(0); was < BulkProcs {
			p.set(BulkProcs)
			p.raised = true
			p.log.Debug("setups in bulk: GOMAXPROCS raised", "setups", setups, "from", was, "to", BulkProcs)
		}
	case p.raised && setups == 0:
		p.restore()
		p.raised = false
		p.log.Debug("bulk setups done: GOMAXPROCS back to the default", "gomaxprocs", p.set(0))
	}
}
