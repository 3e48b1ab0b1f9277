package daemon

import (
	"log/slog"
	"runtime"
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

// restDropEvery is how often, at most, a process at rest unmaps its
// executable's pages again after a collection (heapRelease.collected).
// The Go runtime forces a collection every two minutes at rest
// (runtime/proc.go, forcegcperiod); each maps again the collector's code
// and the type and function tables of what it scans — about 4 MiB for
// the two processes of a small daemon, measured (BENCHMARKS.md).
const restDropEvery = time.Minute

// monitorGCPercent is the garbage collector's target percentage
// (runtime/debug.SetGCPercent: the heap may grow by this share of the
// live heap before the next collection) that the monitor runs with, once
// its configuration is loaded, when the environment sets no GOGC; the
// runtime's default is 100. (At 25 the runtime's smallest heap goal is
// 1 MiB, a quarter of its 4: loading 1,000 mounts' configuration at it
// took twenty collections in its first 0.1 s.)
//
// The monitor keeps little: each mount's writer, status and records,
// about 7.5 MB at 1,000 mounts, and no payload once it is written. What
// it allocates beyond that is an operation's garbage — a cold start's
// 100,000 files are hundreds of megabytes of it. Go does not move
// objects, and the few each operation keeps are made among its garbage:
// once that is collected, each 8 KiB page of a size class stays in use
// for the one or two objects on it that live. The more the heap may grow
// before a collection, the more pages a burst spreads them over.
// Measured at 1,000 mounts of 100 keys (BENCHMARKS.md, "The monitor's
// collector target"), the monitor's anonymous memory at rest after the
// cold start: 22.7–24.5 MiB at 100, 18.6–19.5 at 25 (four runs and
// eight); after every mount changed once 28.8–29.8 and 18.8–21.3. With
// both processes at the setting (a sweep, two runs each): 22.5–24.2 at
// 100, 21.1–23.2 at 50, 18.7–18.8 at 25, 17.8–17.9 at 10, where a
// restart cost the two processes 0.77–0.83 s of CPU against 0.43–0.45 at
// 100. The price at 25: the restarted monitor's CPU until every mount is
// current, 0.30–0.52 s against 0.22–0.27, and a cold start's 12 % more
// on average (38.6 s against 34.4, on a disk whose speed moved as much
// between runs).
//
// The worker keeps the runtime's default: what it holds is its
// snapshots, live, and a restart's reads and payloads are the time
// until every mount is current. A GOGC the operator sets applies to
// both (workerRuntimeEnv).
const monitorGCPercent = 25

// setMonitorGCPercent sets the process's collector target to
// monitorGCPercent unless getenv("GOGC") is set, which is the
// operator's; restore sets back the target found.
func setMonitorGCPercent(getenv func(string) string) (restore func()) {
	if getenv("GOGC") != "" {
		return func() {}
	}
	was := debug.SetGCPercent(monitorGCPercent)
	return func() { debug.SetGCPercent(was) }
}

// processImage is the running executable's mappings (exepages.Find), read
// once for the process's life: every daemon of a monitor's reloads shares
// it, and a worker finds it before its confinement.
var processImage = sync.OnceValues(exepages.Find)

// heapRelease is an observer that returns to the system the free heap
// memory and the goroutine stacks a burst grew (reconcile.ReleaseMemory)
// once burstWrites switches and payloads
// taken or sent (Payload) have happened since the last release and none for
// burstQuiet. A mount with a longer keep_replaced frees its replaced
// versions later; what they held the runtime's scavenger returns in time.
//
// Each release also unmaps the executable's pages (exepages): those of
// the code the burst ran, or the start's, which the process maps again
// only if it runs them again. So does each collection of the Go runtime
// once the process has been quiet for burstQuiet, at most every
// restDropEvery (collected). Measured with one small mount, the two
// processes' PSS at rest falls from 31 to 19–20 MiB (BENCHMARKS.md).
type heapRelease struct {
	log       *slog.Logger
	quiet     time.Duration
	restEvery time.Duration
	// drop unmaps the executable's pages; release returns the free
	// heap and calls drop.
	drop, release func() error

	mu        sync.Mutex
	written   int
	timer     *time.Timer
	lastWrite time.Time // the last switch or payload counted
	lastDrop  time.Time // the last drop; zero until the first release
	stopped   bool
}

// newHeapRelease returns a heapRelease that logs each release to log, at
// the debug level; quiet replaces burstQuiet when not zero (tests). It
// reads the executable's mappings now (processImage), so a worker calls
// it before its Landlock ruleset closes /proc; when they cannot be read,
// or later unmapped, it logs a warning and releases only the heap. It
// follows the runtime's collections (collected) until stop.
func newHeapRelease(log *slog.Logger, quiet time.Duration) *heapRelease {
	if quiet == 0 {
		quiet = burstQuiet
	}
	image, err := processImage()
	if err != nil && log != nil {
		log.Warn("the executable's pages stay mapped", "err", err)
	}
	h := &heapRelease{log: log, quiet: quiet, restEvery: restDropEvery, drop: image.Drop}
	h.release = func() error {
		reconcile.ReleaseMemory()
		return h.drop()
	}
	h.watchCollections()
	return h
}

// now releases the heap and the executable's pages at once, in the
// background, and logs it with why: what the process has just done
// (its first projection, its first payloads), which made most of the
// garbage it will ever make and ran code it will not run again. From then
// on, collections at rest unmap the pages again (collected).
func (h *heapRelease) now(why string) {
	h.mu.Lock()
	h.lastDrop = time.Now()
	h.mu.Unlock()
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

// collectionSentinel is the object whose cleanup tells heapRelease that
// the Go runtime has finished a collection: a new one is made after each,
// unreachable from the start. It holds a pointer, so the runtime's tiny
// allocator, which packs pointer-free objects of less than 16 bytes
// together, gives it a slot of its own.
type collectionSentinel struct{ _ *byte }

// watchCollections calls collected after the runtime's next collection,
// and again after each one until stop (runtime.AddCleanup: a cleanup
// runs once its object is found unreachable, which a collection does).
func (h *heapRelease) watchCollections() {
	runtime.AddCleanup(new(collectionSentinel), func(h *heapRelease) {
		if h.collected() {
			h.watchCollections()
		}
	}, h)
}

// collected is called after each of the runtime's collections. Once the
// process has been released once (now) and has counted no switch or
// payload for quiet, at most once every restEvery, it unmaps the
// executable's pages again, in the background: a collection at rest —
// the one the runtime forces every two minutes — maps the collector's
// code and the tables of everything it scans, which the process does not
// run between them. It reports whether to go on: false once stopped, or
// once such a drop failed.
func (h *heapRelease) collected() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.stopped {
		return false
	}
	now := time.Now()
	if h.lastDrop.IsZero() || now.Sub(h.lastDrop) < h.restEvery || now.Sub(h.lastWrite) < h.quiet || h.written >= burstWrites {
		return true
	}
	h.lastDrop = now
	go func() {
		if err := h.drop(); err != nil {
			// It would fail again: one warning, and no more
			// drops at rest.
			h.mu.Lock()
			h.stopped = true
			h.mu.Unlock()
			if h.log != nil {
				h.log.Warn("the executable's pages stay mapped", "err", err)
			}
		}
	}()
	return true
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
	h.lastWrite = time.Now()
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
	if n >= burstWrites {
		h.lastDrop = time.Now()
	}
	h.mu.Unlock()
	if n >= burstWrites {
		err := h.release()
		h.logRelease(err, "returned the free heap memory to the system after a burst", "switches_and_payloads", n)
	}
}

// stop cancels a release not yet made, and stops following the runtime's
// collections.
func (h *heapRelease) stop() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.stopped = true
	if h.timer != nil {
		h.timer.Stop()
	}
}
