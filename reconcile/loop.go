package reconcile

import (
	"context"
	"errors"
	"maps"
	"slices"
	"time"
)

// The reconciler's loop: a pass over every mount, then a wait for what
// calls for the next one.

// Run reconciles until ctx is done. Then it starts no new operation, waits
// for the running ones to finish — a write in progress completes, so no
// half-built version is left behind —, reports the status a pass left
// unreported (statusEvery), closes the mounts' writers and returns nil.
func (r *Reconciler) Run(ctx context.Context) error {
	r.startedAt = time.Now()
	// Executors of this run's own: shutdown stops them.
	r.execs = newExecutors()
	resync := time.NewTicker(r.opts.ResyncInterval)
	defer resync.Stop()
	defer r.reportUnreported()
	defer r.shutdown()
	for {
		began := time.Now()
		retryAt := r.pass(began)
		var retry <-chan time.Time
		if !retryAt.IsZero() {
			retry = time.After(time.Until(retryAt))
		}
		if !r.wait(ctx, retry, resync, r.passPace(time.Since(began))) {
			return nil
		}
	}
}

// wait waits for what calls for the next pass — a wake-up from the
// populator, no sooner than pace from now (passPace); an operation's
// result; retry; the resync ticker; a ping, an adoption or a reload,
// which it carries out — and reports false when ctx is done instead.
func (r *Reconciler) wait(ctx context.Context, retry <-chan time.Time, resync *time.Ticker, pace time.Duration) bool {
	trigger, gate := r.trigger, (<-chan time.Time)(nil)
	if pace > 0 {
		trigger, gate = nil, time.After(pace)
	}
	for {
		select {
		case <-ctx.Done():
			return false
		case <-gate:
			// Open: wait for the wake-up itself.
			trigger, gate = r.trigger, nil
			continue
		case <-trigger:
		case res := <-r.results:
			r.apply(res)
			// Apply the other results already in before the next pass:
			// a pass looks at every mount, and a cold start with 1,000
			// mounts would otherwise make 1,000 passes one after the
			// other (measured: the first update after it waited 0.6–1.2 s).
			r.applyPending()
		case <-retry:
		case <-resync.C:
			for _, a := range r.asw.Mounts {
				a.VerifyDue = true
			}
			r.changes.markAll()
		case pong := <-r.pings:
			close(pong)
		case req := <-r.adopts:
			req.done <- r.adopt(req.mount)
		case req := <-r.reloads:
			if req.cfg.Sources != nil {
				r.pop.SetSources(req.cfg.Sources)
			}
			err := r.pop.SetMounts(req.cfg.Mounts)
			r.changes.markAll()
			if iv := req.cfg.ResyncInterval; err == nil && iv > 0 && iv != r.opts.ResyncInterval {
				r.opts.ResyncInterval = iv
				resync.Reset(iv)
			}
			req.done <- err
		}
		return true
	}
}

// pass is one turn of the loop at time now: it builds the desired state,
// plans, starts the operations and reports every mount's status. It returns
// when the next pass is due without a wake-up (zero: not before one).
func (r *Reconciler) pass(now time.Time) (retryAt time.Time) {
	dsw := r.pop.Populate()
	r.desiredChanged(dsw)
	releaseAt := r.releaseDue(now)
	names, all := r.changes.take(now, len(r.names))
	if all {
		if !sameNames(r.names, dsw) {
			r.names = slices.Sorted(maps.Keys(dsw))
		}
		names = withTeardowns(r.names, dsw, r.asw)
		r.changes.beginAll()
	}
	r.markPending(dsw, names, all, now)
	ops, retryAt := planSorted(names, dsw, r.asw, now, r.changes.settle)
	if all {
		r.changes.endAll(len(names))
	}
	if at := r.changes.next(); !at.IsZero() && (retryAt.IsZero() || at.Before(retryAt)) {
		retryAt = at
	}
	if verifyPlans {
		r.verifyPlan(dsw, now, ops, retryAt)
	}
	ops, verifyAt := r.schedule(ops, dsw, now)
	for _, at := range []time.Time{verifyAt, releaseAt} {
		if !at.IsZero() && (retryAt.IsZero() || at.Before(retryAt)) {
			retryAt = at
		}
	}
	for _, op := range ops {
		d := dsw[op.Mount]
		if (op.Kind == Setup || op.Kind == Remount) && d.Payload == nil && !keepable(d, r.asw.Mounts[op.Mount]) {
			// Released once written (Releaser), and needed again: drift
			// to repair. The payload is asked for; its arrival wakes
			// the loop, and the mount is remounted then.
			if rel, ok := r.pop.(Releaser); ok {
				if again := rel.Fetch(op.Mount, now); !again.IsZero() && (retryAt.IsZero() || again.Before(retryAt)) {
					retryAt = again
				}
			}
			continue
		}
		r.dispatch(op, d)
	}
	if due := r.reported.Add(statusEvery); r.reported.IsZero() || !now.Before(due) {
		r.opts.Observer.Observe(PassEvent{Mounts: r.status(dsw), Time: now})
		r.reported, r.unreported = now, nil
	} else {
		// This pass's status goes out with the first pass from due on,
		// or when Run ends before one.
		r.unreported = dsw
		if retryAt.IsZero() || due.Before(retryAt) {
			retryAt = due
		}
	}
	return retryAt
}

// desiredChanged has the mounts whose desired state the pass's Populate
// changed planned (ChangeReporter): every mount when the Desired does not
// say, or when a mount it names is new or gone.
func (r *Reconciler) desiredChanged(dsw DesiredState) {
	cr, ok := r.pop.(ChangeReporter)
	if !ok {
		r.changes.markAll()
		return
	}
	if r.markChanged == nil {
		r.markChanged = func(name string) {
			_, desired := r.changedIn[name]
			if _, known := slices.BinarySearch(r.names, name); desired != known {
				r.changes.markAll()
			}
			r.changes.mark(name)
		}
	}
	r.changedIn = dsw
	if !cr.Changed(r.markChanged) {
		r.changes.markAll()
	}
	r.changedIn = nil
}

// reportUnreported reports the status of the last pass, if that pass left
// it for later (statusEvery), with what the operations that ended since
// did: Once's last word on which mounts were projected must not be 50 ms
// old.
func (r *Reconciler) reportUnreported() {
	if r.unreported != nil {
		r.opts.Observer.Observe(PassEvent{Mounts: r.status(r.unreported), Time: time.Now()})
		r.unreported = nil
	}
}

// statusEvery is how often, at most, a pass reports every mount's status
// (PassEvent); a pass sooner leaves it to a pass at the end of the
// interval, which it makes due. Building the status of 1,000 mounts and
// the observers' work on it (the admin endpoint's record and metrics, the
// service's status line) were 40 % of a pass's CPU during a restart,
// when a pass follows every few results, every 3–6 ms (BENCHMARKS.md,
// "A restart's status reported every 50 ms"); a reader of /status, the
// metrics or systemd's STATUS= sees the change at most this much later.
const statusEvery = 50 * time.Millisecond

// While the first reads are held for (holdForFirstReads), a pass can
// start nothing but the changes those reads found, and a restart of 1,000
// mounts made one after each payload that came: 137 passes of 1,000
// mounts each, half the monitor's CPU on two CPUs that the worker and the
// store needed to read (BENCHMARKS.md, "A restart's passes paced"). So
// then the next pass that a wake-up from the populator asks for waits
// passPaceFactor times the last pass's duration, at most maxPassPace; an
// operation's result, a ping, a reload or a retry time does not wait.
const (
	passPaceFactor = 4
	maxPassPace    = 5 * time.Millisecond
)

// passPace returns how long after a pass that took took the next one
// waits for a wake-up from the populator: 0 once the first reads are done.
func (r *Reconciler) passPace(took time.Duration) time.Duration {
	if r.readsDone {
		return 0
	}
	return min(passPaceFactor*took, maxPassPace)
}

// applyPending applies the operation results that are waiting, without
// waiting for more.
func (r *Reconciler) applyPending() {
	for {
		select {
		case res := <-r.results:
			r.apply(res)
		default:
			return
		}
	}
}

// markPending records when a projected mount's desired payload first moved
// past the one written: the start of its quiescence (see Plan), for the
// mounts of names, those a pass plans (a quiet mount's is as it was), or
// for every projected mount (all).
func (r *Reconciler) markPending(dsw DesiredState, names []string, all bool, now time.Time) {
	if all {
		for name, a := range r.asw.Mounts {
			markPendingOne(dsw[name], a, now)
		}
		return
	}
	for _, name := range names {
		if a := r.asw.Mounts[name]; a != nil {
			markPendingOne(dsw[name], a, now)
		}
	}
}

// markPendingOne is markPending for one projected mount a, desired d.
func markPendingOne(d *DesiredMount, a *ActualMount, now time.Time) {
	switch {
	case d == nil || !d.Ready() || a.Generation == d.Generation:
		a.PendingSince = time.Time{}
	case a.PendingSince.IsZero():
		a.PendingSince = now
	}
}

// status returns every desired mount's status, sorted by name.
// r.names holds dsw's names, sorted (see pass).
func (r *Reconciler) status(dsw DesiredState) []MountStatus {
	out := make([]MountStatus, 0, len(dsw))
	for _, name := range r.names {
		d := dsw[name]
		st := MountStatus{Name: name, Dir: d.Spec.Dir, Medium: d.Spec.Medium, Optional: d.Spec.Optional, Waiting: d.Waiting, Stale: d.Stale, Err: d.Err}
		a := r.asw.Mounts[name]
		// Collecting a replaced version or verifying the files leaves the
		// mount's content as it is: only a write takes it out of
		// projected while it runs.
		writing := r.asw.InFlight[name] && r.kinds[name] != Collect && r.kinds[name] != Verify
		st.Projected = a != nil && d.Ready() && a.Generation == d.Generation && !writing
		if f := r.asw.Failures[name]; f != nil && !st.Projected {
			st.Err = f.Err
		}
		if hb := r.asw.HeldBack[name]; hb != nil && hb.Generation == d.Generation {
			st.Stale = append(slices.Clip(st.Stale), hb.Err)
		}
		if a != nil && a.RemountRequired && d.Payload == nil && d.Released {
			st.Stale = append(slices.Clip(st.Stale), errPayloadAsked)
		}
		out = append(out, st)
	}
	return out
}

// errPayloadAsked is the status of a mount whose disk drifted and whose
// payload, released once written (Releaser), is asked for again.
var errPayloadAsked = errors.New("the files drifted from what was written; the payload is asked for again to repair them")

// sameNames reports whether names are exactly the keys of dsw.
func sameNames(names []string, dsw DesiredState) bool {
	if len(names) != len(dsw) {
		return false
	}
	for _, name := range names {
		if _, ok := dsw[name]; !ok {
			return false
		}
	}
	return true
}
