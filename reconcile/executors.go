package reconcile

import (
	"sync"
	"sync/atomic"
)

// executors runs the reconciler's operations on goroutines that outlive
// one operation. A write's goroutine grows its stack to what the atomic
// writer's calls need, doubling it from the few KiB a new goroutine starts
// with (the runtime's minimum, or the average it last measured); a new
// goroutine for every operation grew it anew on every write, copying it
// at each doubling (runtime.morestack was 6.6 % of the
// monitor's CPU samples under a stream of one-key updates, BENCHMARKS.md
// "The operations' goroutines kept"). An executor that finishes its
// operation waits for the next one, unless maxIdle others already wait: a
// burst of setups, which runs hundreds at once, leaves at most maxIdle
// goroutines behind. The Go runtime still shrinks a waiting executor's
// stack at each collection of the garbage collector when it uses less
// than a quarter of it.
//
// Only the reconciler's loop calls run, and stop once the operations in
// flight have ended (shutdown).
type executors struct {
	// work hands an operation to a waiting executor; unbuffered, so a send
	// succeeds only when one waits.
	work chan func()
	// idle counts the executors waiting on work, or about to; live all
	// of them; started every one run began.
	idle, live, started atomic.Int32
	stopped             sync.Once
}

// maxIdle is how many executors at most wait for an operation.
const maxIdle = 8

func newExecutors() *executors {
	return &executors{work: make(chan func())}
}

// run runs op on a waiting executor, or on a new one when none waits.
func (e *executors) run(op func()) {
	select {
	case e.work <- op:
	default:
		e.live.Add(1)
		e.started.Add(1)
		go e.serve(op)
	}
}

// serve runs op and then the operations handed to it, until maxIdle
// executors already wait or stop closes work.
func (e *executors) serve(op func()) {
	defer e.live.Add(-1)
	for {
		op()
		if e.idle.Add(1) > maxIdle {
			e.idle.Add(-1)
			return
		}
		var ok bool
		op, ok = <-e.work
		e.idle.Add(-1)
		if !ok {
			return
		}
	}
}

// stop ends the waiting executors, and each running one once its
// operation returns. run must not be called after it; a second stop does
// nothing.
func (e *executors) stop() { e.stopped.Do(func() { close(e.work) }) }
