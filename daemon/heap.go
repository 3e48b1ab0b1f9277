package daemon

import (
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/exepages"
	"github.com/kvmount/kvmount/reconcile"
)

// After a burst of writes the Go runtime keeps the heap the burst grew:
// the replaced versions live through their grace (keep_replaced) and the
// payloads in flight. Measured at 1,000 mounts of 100 keys, every mount
// changed once: the monitor's anonymous memory went from 46–49 MiB to
// 81–83 MiB, and was still 58–67 MiB three minutes later (BENCHMARKS.md).
// A worker started again sends every mount's payload anew, which switches
// nothing: the monitor held 66–68 MiB after it, against 46–48 at rest.
// As after the cold start (service.Observe), the daemon gives it back
// once such a burst is over.
const (
	// burstWrites is how many switches to a new version and payloads
	// taken from a worker, together, since the last release, make a
	// burst worth a release: a full collection costs a few milliseconds
	// of CPU, which a handful of writes does not repay. An update is a
	// payload and a switch.
	burstWrites = 64
	// burstQuiet is how long without a switch or a payload ends a
	// burst: the default keep_replaced, after which the burst's
	// replaced versions are gone, and a little more.
	burstQuiet = config.DefaultKeepReplaced + 5*time.Second
)

// heapRelease is an observer that returns the free heap memory to the
// system (debug.FreeOSMemory) once burstWrites switches and payloads
// taken or sent (Payload) have happened since the last release and none for
// burstQuiet. A mount with a longer keep_replaced frees its replaced
// versions later; what they held the runtime's scavenger returns in time.
//
// Each release also unmaps the executable's pages (exepages): those of
// the code the burst ran, or the start's, which the process maps again
// only if it runs them again. Measured with one small mount, the two
// processes' PSS at rest falls from 31 to 23 MiB (BENCHMARKS.md).
type heapRelease struct {
	log     *slog.Logger
	quiet   time.Duration
	release func() error

	mu      sync.Mutex
	written int
	timer   *time.Timer
}

// newHeapRelease returns a heapRelease that logs each release to log, at
// the debug level; quiet replaces burstQuiet when not zero (tests). It
// reads the executable's mappings now (exepages.Find), so a worker calls
// it before its Landlock ruleset closes /proc; when they cannot be read,
// or later unmapped, it logs a warning and releases only the heap.
func newHeapRelease(log *slog.Logger, quiet time.Duration) *heapRelease {
	if quiet == 0 {
		quiet = burstQuiet
	}
	image, err := exepages.Find()
	if err != nil && log != nil {
		log.Warn("the executable's pages stay mapped", "err", err)
	}
	return &heapRelease{log: log, quiet: quiet, release: func() error {
		debug.FreeOSMemory()
		return image.Drop()
	}}
}

// now releases the heap and the executable's pages at once, in the
// background, and logs it with why: what the process has just done
// (its first projection, its first payloads), which made most of the
// garbage it will ever make and ran code it will not run again.
func (h *heapRelease) now(why string) {
	go func() {
		err := h.release()
		h.logRelease(err, "returned the free heap memory to the system after "+why)
	}()
}

// logRelease logs a release, with the error of the executable's pages'
// unmapping if any.
func (h *heapRelease) logRelease(err error, msg string, args ...any) {
	if h.log == nil {
		return
	}
	if err != nil {
		h.log.Warn("the executable's pages stay mapped", "err", err)
	}
	h.log.Debug(msg, args...)
}

// Observe counts switches, and (re)arms the release once they and the
// payloads taken make a burst.
func (h *heapRelease) Observe(ev reconcile.Event) {
	p, ok := ev.(reconcile.ProjectedEvent)
	if !ok || p.Change.Empty() {
		return
	}
	h.count()
}

// Payload counts a payload taken from a worker, in the monitor
// (privsep.MonitorOptions.OnPayload), or sent to the monitor, in a worker,
// and (re)arms the release once they and the switches make a burst. It
// does not block.
func (h *heapRelease) Payload() { h.count() }

func (h *heapRelease) count() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.written++
	switch {
	case h.written < burstWrites:
	case h.timer == nil:
		h.timer = time.AfterFunc(h.quiet, h.fire)
	default:
		h.timer.Reset(h.quiet)
	}
}

// fire releases the heap unless the burst was released already (a Reset
// raced the timer's end).
func (h *heapRelease) fire() {
	h.mu.Lock()
	n := h.written
	h.written = 0
	h.mu.Unlock()
	if n >= burstWrites {
		err := h.release()
		h.logRelease(err, "returned the free heap memory to the system after a burst", "switches_and_payloads", n)
	}
}

// stop cancels a release not yet made.
func (h *heapRelease) stop() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.timer != nil {
		h.timer.Stop()
	}
}
