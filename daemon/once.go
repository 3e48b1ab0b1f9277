package daemon

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvmount/kvmount/reconcile"
)

// OnceError lists the mounts that Once could not project.
type OnceError struct {
	// Failed maps each non-optional mount that was not projected to why.
	Failed map[string]string
}

// Error lists the mounts not projected and why, one per line.
func (e *OnceError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d mount(s) not projected:", len(e.Failed))
	for name, why := range e.Failed {
		fmt.Fprintf(&b, "\n  %s: %s", name, why)
	}
	return b.String()
}

// Once projects every mount once and returns when each has settled (see
// Run's readiness) or timeout has passed. It returns nil when every
// non-optional mount was projected, an *OnceError naming the others, or the
// configuration's error. Like Run, it holds the state directory's lock
// while it works (see ErrLocked). It sends no notifications and serves no
// admin endpoint: it is for provisioning, before the services that read
// the mounts start.
func Once(ctx context.Context, opts Options, timeout time.Duration) error {
	var final []reconcile.MountStatus
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	d, err := load(opts, reconcile.ObserverFunc(func(ev reconcile.Event) {
		if pass, ok := ev.(reconcile.PassEvent); ok {
			final = pass.Mounts
			if settled(pass.Mounts) {
				cancel()
			}
		}
	}), nil)
	if err != nil {
		return err
	}
	err = d.rec.Run(ctx)
	d.close()
	if err != nil {
		return err
	}
	failed := map[string]string{}
	for _, m := range final {
		if m.Projected || m.Optional {
			continue
		}
		switch {
		case m.Err != nil:
			failed[m.Name] = m.Err.Error()
		case len(m.Stale) > 0:
			failed[m.Name] = errors.Join(m.Stale...).Error()
		case len(m.Waiting) > 0:
			failed[m.Name] = fmt.Sprintf("no snapshot from %s within %v", strings.Join(m.Waiting, ", "), timeout)
		default:
			failed[m.Name] = fmt.Sprintf("not projected within %v", timeout)
		}
	}
	if len(failed) > 0 {
		return &OnceError{Failed: failed}
	}
	return nil
}
