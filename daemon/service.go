package daemon

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/reconcile"
	"github.com/kvmount/kvmount/untrusted"
)

// service tells systemd (through Options.Notify) what the daemon is doing:
// READY once every mount has settled, a STATUS= summary after each pass
// that changes it, the watchdog heartbeat. It observes the reconciler's
// events.
type service struct {
	notify func(state string)
	// release returns the memory the first projection left (heapRelease.now)
	// without blocking; nil: nothing is released.
	release func(why string)

	mu     sync.Mutex
	ready  bool
	status string
	// mounts are the mounts' status after the last pass; notified holds
	// the error of each mount's last notification attempt, "" after a
	// success.
	mounts   []reconcile.MountStatus
	notified map[string]string
}

// send passes state to Options.Notify, if set.
func (s *service) send(state string) {
	if s != nil && s.notify != nil {
		s.notify(state)
	}
}

// Observe reports readiness once every mount has settled, and the status
// line whenever it changes.
func (s *service) Observe(ev reconcile.Event) {
	pass, ok := ev.(reconcile.PassEvent)
	if !ok {
		return
	}
	s.mu.Lock()
	first := !s.ready && settled(pass.Mounts)
	if first {
		s.ready = true
	}
	s.mounts = pass.Mounts
	line, changed := s.updateLine()
	s.mu.Unlock()
	if changed {
		s.send("status=" + line)
	}
	if first {
		s.send("ready")
		// Projecting every mount from cold makes most of the garbage the
		// daemon will ever make; give it back to the system now rather
		// than when the runtime's scavenger gets to it (measured with
		// 100,000 keys: RSS at rest 143 MiB without, see BENCHMARKS.md),
		// and unmap the start's code. In the background: Observe must not
		// block the loop.
		if s.release != nil {
			s.release("the first projection")
		}
	}
}

// notifyResult records a notification attempt's outcome, which the status
// line shows (notify_failed), from the notifier's goroutines.
func (s *service) notifyResult(r notify.Result) {
	s.mu.Lock()
	if s.notified == nil {
		s.notified = map[string]string{}
	}
	s.notified[r.Mount] = ""
	if r.Err != nil {
		s.notified[r.Mount] = fmt.Sprintf("notification %s %s: %v", r.Kind, r.Target, r.Err)
	}
	line, changed := s.updateLine()
	s.mu.Unlock()
	if changed {
		s.send("status=" + line)
	}
}

// updateLine makes the status line anew and reports whether it changed;
// s.mu is held.
func (s *service) updateLine() (string, bool) {
	line := statusLine(s.mounts, s.notified)
	changed := line != s.status
	s.status = line
	return line, changed
}

// watchdog sends "watchdog" every interval while ping — the reconciler's
// loop answering — succeeds within the interval: a stuck loop stops the
// heartbeat and systemd restarts the service (WatchdogSec=).
func (s *service) watchdog(ctx context.Context, interval time.Duration, ping func(context.Context) error) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, interval)
		err := ping(pctx)
		cancel()
		if err == nil {
			s.send("watchdog")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// settled reports whether every mount is projected or has met an error
// (its payload failed, its operation failed, or its source is unreachable).
func settled(st []reconcile.MountStatus) bool {
	for _, m := range st {
		if !m.Projected && m.Err == nil && len(m.Stale) == 0 {
			return false
		}
	}
	return true
}

// statusLine summarises mounts for systemd's STATUS=, such as "12 mounts:
// 11 current, 1 stale (api: source main unreachable)": the counts by state
// — admin.MountState's words, as /status and kvmount status use them — and
// the first mount that is not current, with why, escaped
// (untrusted.Escape). A check's output never goes there: systemctl status
// shows the line to every local user. notified holds the error of each
// mount's last notification attempt.
func statusLine(mounts []reconcile.MountStatus, notified map[string]string) string {
	counts := map[string]int{}
	first := ""
	for _, m := range mounts {
		state, why := admin.MountState(m, notified[m.Name])
		if state == admin.StateOptional {
			state = admin.StateCurrent
		}
		counts[state]++
		var check *reconcile.CheckError
		if errors.As(m.Err, &check) {
			// STATUS= is every local user's to read (systemctl
			// status): never a command's output.
			why = check.Brief()
		}
		if first == "" && why != "" {
			first = fmt.Sprintf("%s: %s", m.Name, untrusted.Escape(firstLine(why)))
		}
	}
	states := make([]string, 0, len(counts))
	for state := range counts {
		states = append(states, state)
	}
	sort.Slice(states, func(i, j int) bool { return order(states[i]) < order(states[j]) })
	parts := make([]string, len(states))
	for i, state := range states {
		parts[i] = fmt.Sprintf("%d %s", counts[state], state)
	}
	line := fmt.Sprintf("%d mount", len(mounts))
	if len(mounts) != 1 {
		line += "s"
	}
	if len(parts) > 0 {
		line += ": " + strings.Join(parts, ", ")
	}
	if first != "" {
		line += " (" + first + ")"
	}
	return line
}

// stateOrder is the order of states in the status line.
var stateOrder = []string{admin.StateCurrent, admin.StatePending, admin.StateWaiting, admin.StateStale, admin.StateFailed, admin.StateNotifyFailed}

func order(state string) int { return slices.Index(stateOrder, state) }

// statusWhyLimit bounds the reason in the status line, in bytes: room for
// a failed check's last lines of output (reconcile.CheckOutputLimit).
const statusWhyLimit = 512

// firstLine cuts s at its first newline and at statusWhyLimit bytes.
func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > statusWhyLimit {
		s = strings.ToValidUTF8(s[:statusWhyLimit-3], "") + "..."
	}
	return s
}

// notifyChanges hands every switch that changed a mount to the notifier.
type notifyChanges struct{ n *notify.Notifier }

func (o notifyChanges) Observe(ev reconcile.Event) {
	p, ok := ev.(reconcile.ProjectedEvent)
	if !ok || p.Change.Empty() {
		// An adopted mount (a restart that found the content unchanged)
		// is no change.
		return
	}
	o.n.Notify(notify.Change{Mount: p.Mount, Dir: p.Dir, Version: p.Version, Revision: p.Revision,
		Added: p.Change.Added, Changed: p.Change.Changed, Removed: p.Change.Removed})
}
