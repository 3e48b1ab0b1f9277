package daemon

import (
	"context"
	"fmt"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/reconcile"
)

// service tells systemd (through Options.Notify) what the daemon is doing:
// READY once every mount has settled, a STATUS= summary after each pass
// that changes it, the watchdog heartbeat. It observes the reconciler's
// events.
type service struct {
	notify func(state string)

	mu     sync.Mutex
	ready  bool
	status string
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
	line := statusLine(pass.Mounts)
	changed := line != s.status
	s.status = line
	s.mu.Unlock()
	if changed {
		s.send("status=" + line)
	}
	if first {
		s.send("ready")
		// Projecting every mount from cold makes most of the garbage the
		// daemon will ever make; give it back to the system now rather
		// than when the runtime's scavenger gets to it (measured with
		// 100,000 keys: RSS at rest 143 MiB without, see BENCHMARKS.md).
		// On its own goroutine: Observe must not block the loop.
		go debug.FreeOSMemory()
	}
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
// and the first mount that is not current, with why.
func statusLine(mounts []reconcile.MountStatus) string {
	counts := map[string]int{}
	first := ""
	for _, m := range mounts {
		state, why := "current", ""
		switch {
		case m.Projected && len(m.Stale) == 0:
		case m.Err != nil:
			state, why = "failing", m.Err.Error()
		case len(m.Stale) > 0:
			state, why = "stale", m.Stale[0].Error()
		case len(m.Waiting) > 0:
			state, why = "waiting", "waiting for "+strings.Join(m.Waiting, ", ")
		default:
			state = "updating"
		}
		counts[state]++
		if first == "" && why != "" {
			first = fmt.Sprintf("%s: %s", m.Name, firstLine(why))
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

func order(state string) int {
	return strings.Index("current updating waiting stale failing", state)
}

// firstLine cuts s at its first newline and at 120 bytes.
func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 120 {
		s = s[:117] + "..."
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
