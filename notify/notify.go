// Package notify tells local services that a mount changed, after its new
// version is visible: a command, a signal to a process named by a PID file,
// a systemd unit reloaded or restarted over D-Bus, or a webhook.
//
// The rules (DESIGN.md, "Notification rules"): a notification is sent only
// after the switch, once per switch and in order; never two at once for one
// mount — changes that arrive while one runs coalesce into one more, for
// the newest version; a failed entry alone is retried with backoff (1 s
// doubling to 2 min) until it succeeds or a newer version supersedes it; a
// failure never rolls content back and never holds up another mount. An
// entry's backoff holds for every version: a newer version notifies at
// once unless that entry is failing, in which case it waits out the
// entry's backoff first. Each mount has its own worker goroutine, owned by
// the Notifier.
package notify

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/kvmount/kvmount/config"
)

// Retry limits of a failed notification entry.
const (
	RetryMin = time.Second
	RetryMax = 2 * time.Minute
)

// Change is one switch of a mount to a new version that changed it.
type Change struct {
	// Mount is the mount's name; Dir its directory.
	Mount, Dir string
	// Version is the version directory ..data names now.
	Version string
	// Revision names the snapshots the version was built from, such as
	// "main@1042".
	Revision string
	// Added, Changed and Removed are paths relative to Dir; never values.
	Added, Changed, Removed []string
}

// Result is the outcome of one attempt of one notification entry.
type Result struct {
	// Mount and Version are those of the Change notified.
	Mount, Version string
	// Kind is the entry's kind: "command", "signal", "systemd_unit" or
	// "webhook"; Target says what it addressed (a program, PID file,
	// unit or URL, without credentials).
	Kind, Target string
	// Attempt counts the attempts for this entry and version, from 1.
	Attempt int
	// Err is nil on success.
	Err error
	// Duration is how long the attempt took.
	Duration time.Duration
	// Time is when it ended.
	Time time.Time
}

// Options configure a Notifier.
type Options struct {
	// Log receives a line per attempt: exit status and errors at info or
	// warn, a command's output at debug.
	Log *slog.Logger
	// OnResult, when set, is called after every attempt, from the mount's
	// worker goroutine; it must not block for long.
	OnResult func(Result)
	// Webhooks delivers webhooks; nil means Deliver with HTTPClient, in
	// this process. kvmount's monitor has its unprivileged worker deliver
	// them, so that no response is read by root.
	Webhooks WebhookPoster
	// HTTPClient sends webhooks when Webhooks is nil; nil means a client
	// like http.DefaultClient. Its CheckRedirect is replaced, per entry,
	// by origin.CheckRedirect.
	HTTPClient *http.Client
	// SystemdConn connects to systemd; nil means the system bus.
	SystemdConn SystemdConnector
}

// Notifier runs the notifications of every mount.
type Notifier struct {
	opts   Options
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	workers map[string]*worker
	wg      sync.WaitGroup
}

// New returns a Notifier with no mounts.
func New(opts Options) *Notifier {
	if opts.HTTPClient == nil {
		opts.HTTPClient = &http.Client{}
	}
	if opts.SystemdConn == nil {
		opts.SystemdConn = systemBus{}
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Notifier{opts: opts, ctx: ctx, cancel: cancel, workers: map[string]*worker{}}
}

// SetMounts makes mounts' notify entries the ones in force. A mount
// without entries, or no longer configured, has its worker stopped (a
// notification it is running is cancelled).
func (n *Notifier) SetMounts(mounts []*config.Mount) {
	n.mu.Lock()
	defer n.mu.Unlock()
	keep := map[string]bool{}
	for _, m := range mounts {
		if len(m.Notify) == 0 {
			continue
		}
		keep[m.Name] = true
		w := n.workers[m.Name]
		if w == nil {
			ctx, cancel := context.WithCancel(n.ctx)
			w = &worker{n: n, mount: m.Name, wake: make(chan struct{}, 1), cancel: cancel, backoff: map[int]*entryBackoff{}}
			n.workers[m.Name] = w
			n.wg.Add(1)
			go func() {
				defer n.wg.Done()
				w.run(ctx)
			}()
		}
		w.setEntries(m.Notify)
	}
	for name, w := range n.workers {
		if !keep[name] {
			w.cancel()
			delete(n.workers, name)
		}
	}
}

// Notify hands c to its mount's worker without blocking. A change that
// arrives while the worker is busy replaces any other waiting one: the
// worker then notifies once more, for the newest version. A mount without
// notify entries ignores it.
func (n *Notifier) Notify(c Change) {
	n.mu.Lock()
	w := n.workers[c.Mount]
	n.mu.Unlock()
	if w != nil {
		w.offer(c)
	}
}

// Close stops every worker, cancelling the notifications running, and
// waits for them.
func (n *Notifier) Close() {
	n.cancel()
	n.wg.Wait()
}

// worker runs one mount's notifications, one change at a time.
type worker struct {
	n      *Notifier
	mount  string
	wake   chan struct{}
	cancel context.CancelFunc

	mu      sync.Mutex
	entries []config.Notify
	pending *Change

	// backoff is each entry's retry state, by index, across versions: an
	// entry that failed waits out its backoff before its next attempt,
	// for whatever version — so that newer versions arriving while a
	// target keeps failing never make it run faster than the backoff.
	// Only the worker's goroutine touches it.
	backoff map[int]*entryBackoff
}

// entryBackoff is a failing entry's next allowed attempt and the delay
// after its next failure.
type entryBackoff struct {
	next  time.Time
	delay time.Duration
}

func (w *worker) setEntries(entries []config.Notify) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.entries = slices.Clone(entries)
}

func (w *worker) offer(c Change) {
	w.mu.Lock()
	w.pending = &c
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// take returns the waiting change, if any, and the entries in force.
func (w *worker) take() (*Change, []config.Notify) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.pending
	w.pending = nil
	return c, w.entries
}

// superseded reports whether a newer change waits.
func (w *worker) superseded() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.pending != nil
}

func (w *worker) run(ctx context.Context) {
	var entries []config.Notify
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		}
		for {
			c, now := w.take()
			if c == nil {
				break
			}
			if !slices.EqualFunc(entries, now, sameEntry) {
				entries, w.backoff = now, map[int]*entryBackoff{} // a reload: start afresh
			}
			w.notify(ctx, *c, entries)
		}
	}
}

// sameEntry reports whether two entries are the same configuration.
func sameEntry(a, b config.Notify) bool { return reflect.DeepEqual(a, b) }

// notify runs entries for c in order. A failed entry is retried alone with
// backoff; a newer change waiting ends the retries (it will be notified
// from the first entry, each entry still waiting out its backoff).
func (w *worker) notify(ctx context.Context, c Change, entries []config.Notify) {
	log := w.n.opts.Log.With("mount", c.Mount, "version", c.Version)
	for i, e := range entries {
		for attempt := 1; ; attempt++ {
			if !w.waitBackoff(ctx, i) {
				if ctx.Err() == nil {
					log.Info("notification superseded by a newer version", "kind", e.Kind, "target", e.Target())
				}
				return
			}
			start := time.Now()
			err := w.n.run(ctx, e, c, log)
			if ctx.Err() != nil {
				return
			}
			res := Result{Mount: c.Mount, Version: c.Version, Kind: e.Kind, Target: e.Target(), Attempt: attempt, Err: err, Duration: time.Since(start), Time: time.Now()}
			if w.n.opts.OnResult != nil {
				w.n.opts.OnResult(res)
			}
			if err == nil {
				delete(w.backoff, i)
				log.Info("notified", "kind", e.Kind, "target", e.Target(), "attempt", attempt, "duration", res.Duration)
				break
			}
			b := w.backoff[i]
			if b == nil {
				b = &entryBackoff{delay: RetryMin}
				w.backoff[i] = b
			} else {
				b.delay = min(2*b.delay, RetryMax)
			}
			b.next = time.Now().Add(b.delay)
			log.Warn("notification failed; retrying", "kind", e.Kind, "target", e.Target(), "attempt", attempt, "retry_in", b.delay, "err", err)
		}
	}
}

// waitBackoff waits until entry i may be attempted again. It returns false,
// at once, when a newer change waits or ctx is done; a wake-up without a
// newer change (there is none to take) goes on waiting.
func (w *worker) waitBackoff(ctx context.Context, i int) bool {
	for {
		if w.superseded() || ctx.Err() != nil {
			return false
		}
		b := w.backoff[i]
		if b == nil || !time.Now().Before(b.next) {
			return true
		}
		t := time.NewTimer(time.Until(b.next))
		select {
		case <-ctx.Done():
		case <-t.C:
		case <-w.wake:
		}
		t.Stop()
	}
}

// run performs one attempt of entry e for c.
func (n *Notifier) run(ctx context.Context, e config.Notify, c Change, log *slog.Logger) error {
	switch e.Kind {
	case config.NotifyCommand:
		return runCommand(ctx, e, c, log)
	case config.NotifySignal:
		return n.sendSignal(ctx, e)
	case config.NotifySystemd:
		return n.systemdJob(ctx, e)
	case config.NotifyWebhook:
		return n.postWebhook(ctx, e, c)
	}
	return fmt.Errorf("notify: unknown kind %q", e.Kind)
}
