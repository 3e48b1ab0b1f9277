package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"slices"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/projector"
)

// Trigger wakes the reconciler. It holds one pending wake-up, so a burst of
// changes costs one pass. The source cache fires it on every feed change.
type Trigger chan struct{}

// NewTrigger returns a Trigger.
func NewTrigger() Trigger { return make(Trigger, 1) }

// Fire wakes the reconciler without blocking.
func (t Trigger) Fire() {
	select {
	case t <- struct{}{}:
	default:
	}
}

// MountStatus is one mount's state after a reconciler pass.
type MountStatus struct {
	Name     string
	Optional bool
	// Projected reports that the mount holds its current desired payload.
	Projected bool
	// Err is why it does not: the payload cannot be built, or the last
	// operation failed.
	Err error
	// Waiting names sources whose first snapshot has not arrived.
	Waiting []string
	// Stale holds errors of sources that cannot be read now.
	Stale []error
}

// Options configure a Reconciler.
type Options struct {
	// ResyncInterval is how often every projected mount is verified
	// against the disk; drift is repaired. Zero means
	// config.DefaultResyncInterval.
	ResyncInterval time.Duration
	// OnSync, when set, is called after every pass with the status of
	// every desired mount, sorted by name. It runs on the reconciler's
	// goroutine and must not block.
	OnSync func([]MountStatus)
}

// Reconciler makes the actual state of world match the desired one (the
// kubelet's volume reconciler). It is event-driven: a pass runs when the
// trigger fires, an operation ends, a backoff expires, a reload arrives or
// the resync ticks; idle, it uses no CPU.
type Reconciler struct {
	log     *slog.Logger
	pop     *Populator
	owned   *Owned
	trigger Trigger
	opts    Options

	asw      *ActualState
	runtimes map[string]*runtime
	results  chan result
	reloads  chan reloadRequest
}

// runtime is what an operation needs beyond the ASW: the mount's open
// atomic writer and what it last wrote. Only the loop touches it, except
// while the mount's one operation runs.
type runtime struct {
	writer  *projector.AtomicWriter
	spec    *config.Mount
	written projector.Payload
}

type result struct {
	op         Op
	spec       *config.Mount
	generation uint64
	revision   string
	version    string
	change     projector.Change
	drift      error
	err        error
	duration   time.Duration
}

type reloadRequest struct {
	mounts []*config.Mount
	done   chan error
}

// New returns a reconciler whose actual state starts from owned: every
// recorded mount is taken as projected at an unknown generation, so that it
// is adopted (compared, not rewritten) when still configured and torn down
// when not.
func New(pop *Populator, owned *Owned, trigger Trigger, log *slog.Logger, opts Options) *Reconciler {
	if opts.ResyncInterval <= 0 {
		opts.ResyncInterval = config.DefaultResyncInterval
	}
	r := &Reconciler{
		log: log, pop: pop, owned: owned, trigger: trigger, opts: opts,
		asw:      NewActualState(),
		runtimes: map[string]*runtime{},
		results:  make(chan result),
		reloads:  make(chan reloadRequest),
	}
	for name, rec := range owned.All() {
		r.asw.Mounts[name] = &ActualMount{Dir: rec.Dir, Medium: rec.Medium}
	}
	return r
}

// Reload makes mounts the configured mounts (see Populator.SetMounts). It
// returns once the loop has taken them, or ctx's error.
func (r *Reconciler) Reload(ctx context.Context, mounts []*config.Mount) error {
	req := reloadRequest{mounts: mounts, done: make(chan error, 1)}
	select {
	case r.reloads <- req:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-req.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Run reconciles until ctx is done. Then it starts no new operation, waits
// for the running ones to finish — a write in progress completes, so no
// half-built version is left behind — closes the mounts' writers and
// returns nil.
func (r *Reconciler) Run(ctx context.Context) error {
	resync := time.NewTicker(r.opts.ResyncInterval)
	defer resync.Stop()
	defer r.shutdown()
	for {
		dsw := r.pop.Populate()
		ops, retryAt := Plan(dsw, r.asw, time.Now())
		for _, op := range ops {
			r.dispatch(op, dsw[op.Mount])
		}
		if r.opts.OnSync != nil {
			r.opts.OnSync(r.status(dsw))
		}
		var retry <-chan time.Time
		if !retryAt.IsZero() {
			retry = time.After(time.Until(retryAt))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-r.trigger:
		case res := <-r.results:
			r.apply(res)
		case <-retry:
		case <-resync.C:
			for _, a := range r.asw.Mounts {
				a.VerifyDue = true
			}
		case req := <-r.reloads:
			req.done <- r.pop.SetMounts(req.mounts)
		}
	}
}

// shutdown waits for the operations in flight and closes every writer.
func (r *Reconciler) shutdown() {
	for len(r.asw.InFlight) > 0 {
		r.apply(<-r.results)
	}
	for _, rt := range r.runtimes {
		if rt.writer != nil {
			rt.writer.Close()
			rt.writer = nil
		}
	}
}

// dispatch starts op in its own goroutine, which Run waits for.
func (r *Reconciler) dispatch(op Op, d *DesiredMount) {
	rt := r.runtimes[op.Mount]
	if rt == nil {
		rt = &runtime{}
		r.runtimes[op.Mount] = rt
	}
	var actual ActualMount
	if a := r.asw.Mounts[op.Mount]; a != nil {
		actual = *a
	}
	r.asw.InFlight[op.Mount] = true
	go func() {
		r.results <- r.execute(op, d, actual, rt)
	}()
}

// execute runs one operation. It touches only the mount's runtime and the
// disk.
func (r *Reconciler) execute(op Op, d *DesiredMount, a ActualMount, rt *runtime) result {
	start := time.Now()
	res := result{op: op}
	switch op.Kind {
	case Setup, Remount:
		res.spec, res.generation, res.revision = d.Spec, d.Generation, d.Revision
		res.change, res.err = r.project(op.Mount, d.Spec, rt, d.Payload)
	case Teardown:
		res.err = r.teardown(op.Mount, a.Dir, rt)
	case Verify:
		res.drift, res.err = r.verify(op.Mount, rt)
	}
	if rt.writer != nil {
		res.version = rt.writer.Version()
	}
	res.duration = time.Since(start)
	return res
}

// project writes payload into the mount, opening (and adopting) its
// directory first if needed.
func (r *Reconciler) project(name string, spec *config.Mount, rt *runtime, payload projector.Payload) (projector.Change, error) {
	if rt.writer != nil && (rt.spec.UID != spec.UID || rt.spec.GID != spec.GID) {
		// The writer carries the directories' owner: open it anew.
		rt.writer.Close()
		rt.writer = nil
	}
	if rt.writer == nil {
		if err := r.open(name, spec, rt); err != nil {
			return projector.Change{}, err
		}
	}
	change, err := rt.writer.Write(payload)
	if err != nil {
		return change, fmt.Errorf("mount %q: %w", name, err)
	}
	rt.written = payload
	return change, nil
}

// open prepares the mount directory, records the mount as owned and adopts
// what the directory holds. A directory that does not exist is recorded
// before it is created, so that a crash in between leaves nothing unowned.
func (r *Reconciler) open(name string, spec *config.Mount, rt *runtime) error {
	rec := Record{Dir: spec.Dir, Medium: spec.Medium}
	exists, err := fsutil.DirExists(spec.Dir)
	switch {
	case err != nil:
		return fmt.Errorf("mount %q: %w", name, err)
	case !exists:
		rec.CreatedDir = true
		if err := r.owned.Set(name, rec); err != nil {
			return err
		}
		if err := fsutil.MakeDir(spec.Dir, 0o755, spec.UID, spec.GID); err != nil {
			return fmt.Errorf("mount %q: %w", name, err)
		}
	default:
		if old, ok := r.owned.Get(name); ok && old.Dir == spec.Dir {
			rec.CreatedDir = old.CreatedDir
		}
	}
	w, err := projector.OpenAtomicWriter(spec.Dir, projector.WriterOptions{
		Sync:   spec.Medium == config.MediumDisk,
		DirUID: spec.UID,
		DirGID: spec.GID,
	})
	if err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	if _, err := w.Adopt(); err != nil {
		w.Close()
		return fmt.Errorf("mount %q: %w", name, err)
	}
	if err := r.owned.Set(name, rec); err != nil {
		w.Close()
		return err
	}
	rt.writer, rt.spec = w, spec
	return nil
}

// teardown removes what kvmount wrote into dir, the directory too if
// kvmount created it, and forgets the mount.
func (r *Reconciler) teardown(name, dir string, rt *runtime) error {
	rec, known := r.owned.Get(name)
	if rt.writer == nil {
		if _, err := os.Lstat(dir); errors.Is(err, fs.ErrNotExist) {
			return r.owned.Delete(name)
		}
		w, err := projector.OpenAtomicWriter(dir, projector.WriterOptions{DirUID: -1, DirGID: -1})
		if err != nil {
			return fmt.Errorf("mount %q: %w", name, err)
		}
		rt.writer = w
	}
	if err := rt.writer.Teardown(); err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	rt.writer.Close()
	rt.writer, rt.spec, rt.written = nil, nil, nil
	if known && rec.CreatedDir && rec.Dir == dir {
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			r.log.Warn("mount directory kept: it holds files kvmount did not write", "mount", name, "dir", dir, "err", err)
		}
	}
	return r.owned.Delete(name)
}

// verify compares the mount with the disk and, on drift, rewrites what was
// last written. It returns the drift found and the repair's error.
func (r *Reconciler) verify(name string, rt *runtime) (drift, err error) {
	if rt.writer == nil || rt.written == nil {
		return nil, nil // adopted, not yet compared: the next remount does
	}
	drift = rt.writer.Verify()
	if drift == nil {
		return nil, nil
	}
	if !errors.Is(drift, projector.ErrDrift) {
		return nil, fmt.Errorf("mount %q: %w", name, drift)
	}
	// Reopen: the directory itself may have been removed or replaced.
	rt.writer.Close()
	rt.writer = nil
	_, err = r.project(name, rt.spec, rt, rt.written)
	return drift, err
}

// apply records an operation's result in the actual state and logs it.
func (r *Reconciler) apply(res result) {
	name := res.op.Mount
	delete(r.asw.InFlight, name)
	log := r.log.With("mount", name)
	if res.err != nil {
		f := r.asw.Failures[name]
		if f == nil {
			f = &Failure{}
			r.asw.Failures[name] = f
		}
		f.Count++
		delay := BackoffDelay(f.Count)
		f.NextRetry = time.Now().Add(delay)
		f.Generation = res.generation
		f.Err = res.err
		if a := r.asw.Mounts[name]; a != nil && res.drift != nil {
			a.RemountRequired = true
		}
		log.Error("operation failed; keeping last content", "op", res.op.Kind.String(), "attempt", f.Count, "retry_in", delay, "err", res.err)
		return
	}
	delete(r.asw.Failures, name)
	switch res.op.Kind {
	case Setup, Remount:
		a := r.asw.Mounts[name]
		if a == nil {
			a = &ActualMount{}
			r.asw.Mounts[name] = a
		}
		a.Dir, a.Medium, a.Generation, a.Version, a.RemountRequired = res.spec.Dir, res.spec.Medium, res.generation, res.version, false
		if !res.change.Empty() {
			log.Info("projected", "revision", res.revision, "version", res.version,
				"added", len(res.change.Added), "changed", len(res.change.Changed), "removed", len(res.change.Removed),
				"duration", res.duration)
		}
	case Teardown:
		a := r.asw.Mounts[name]
		delete(r.asw.Mounts, name)
		delete(r.runtimes, name)
		if a != nil {
			log.Info("torn down", "dir", a.Dir)
		}
	case Verify:
		if a := r.asw.Mounts[name]; a != nil {
			a.VerifyDue = false
			a.Version = res.version
		}
		if res.drift != nil {
			log.Warn("repaired drift", "drift", res.drift, "duration", res.duration)
		}
	}
}

// status returns every desired mount's status, sorted by name.
func (r *Reconciler) status(dsw DesiredState) []MountStatus {
	out := make([]MountStatus, 0, len(dsw))
	for name, d := range dsw {
		st := MountStatus{Name: name, Optional: d.Spec.Optional, Waiting: d.Waiting, Stale: d.Stale, Err: d.Err}
		a := r.asw.Mounts[name]
		st.Projected = a != nil && d.Ready() && a.Generation == d.Generation && !r.asw.InFlight[name]
		if f := r.asw.Failures[name]; f != nil && !st.Projected {
			st.Err = f.Err
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b MountStatus) int { return cmp.Compare(a.Name, b.Name) })
	return out
}
