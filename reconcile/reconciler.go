package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/source"
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
	Dir      string
	Medium   string
	Optional bool
	// Projected reports that the mount holds its current desired payload.
	Projected bool
	// Err is why it does not: the payload cannot be built, or the last
	// operation failed.
	Err error
	// Waiting names sources whose first snapshot has not arrived.
	Waiting []string
	// Stale holds errors of sources that cannot be read now, and a
	// payload held back by a guard rail.
	Stale []error
}

// Options configure a Reconciler.
type Options struct {
	// ResyncInterval is how often every projected mount is verified
	// against the disk; drift is repaired. Zero means
	// config.DefaultResyncInterval.
	ResyncInterval time.Duration
	// Abort, when closed after Run's context is done, cuts short the
	// operations still running: a check_command is killed (the write it
	// guards fails and the mount keeps its content). Writes themselves are
	// short and always finish.
	Abort <-chan struct{}
	// Observer receives every event (see Observer); nil drops them.
	Observer Observer
}

// Reconciler makes the actual state of world match the desired one (the
// kubelet's volume reconciler). It is event-driven: a pass runs when the
// trigger fires, an operation ends, a backoff or quiescence expires, a
// reload arrives or the resync ticks; idle, it uses no CPU. The operations
// themselves (operations.go) run on goroutines of their own, one per mount
// at most, as the kubelet's operation executor runs them; those goroutines
// outlive an operation and take the next (executors.go).
type Reconciler struct {
	log     *slog.Logger
	pop     Desired
	owned   *Owned
	trigger Trigger
	opts    Options

	asw      *ActualState
	runtimes map[string]*runtime
	// opCtx is the context of operations' commands, cancelled by
	// Options.Abort.
	opCtx    context.Context
	opCancel context.CancelFunc
	results  chan result
	// execs runs the operations (executors.go).
	execs   *executors
	reloads chan reloadRequest
	adopts  chan adoptRequest
	pings   chan chan struct{}
	// names are the desired mounts' names, sorted: the order in which a
	// pass plans and reports them, sorted again only when the mounts
	// change.
	names []string
	// running holds the class of each operation in flight, verifyAt when
	// the next verification may start, and digests the desired payloads'
	// digests of mounts not yet adopted (schedule.go).
	running map[string]opClass
	// kinds holds the kind of each operation in flight.
	kinds    map[string]OpKind
	verifyAt time.Time
	digests  map[string]digestAt
	// openFiles is the soft limit on open files; startedAt is when Run
	// began, and readsDone is set once nothing waits any longer for the
	// sources' first reads (schedule.go).
	openFiles uint64
	startedAt time.Time
	readsDone bool
	// procs raises GOMAXPROCS while setups run in bulk (procs.go).
	procs *procs
	// releasing holds the mounts whose payload waits to be released
	// (release.go).
	releasing map[string]struct{}
	// reported is when a pass last reported every mount's status;
	// unreported is the desired state of the last pass if it left its
	// status for later (statusEvery, loop.go).
	reported   time.Time
	unreported DesiredState
	// changes are the mounts the next pass plans (changes.go);
	// markChanged marks those a Populate changed, in changedIn, its
	// desired state (desiredChanged) — kept, so that a pass allocates
	// no closure.
	changes     *changes
	markChanged func(name string)
	changedIn   DesiredState
}

type reloadRequest struct {
	cfg  ReloadConfig
	done chan error
}

type adoptRequest struct {
	mount string
	done  chan error
}

// Desired builds the desired state of world for the Reconciler: the
// Populator, from the sources' snapshots in this process, or the monitor's
// copy of what its worker built (privsep.Remote). Its methods are called
// on the reconciler's loop.
type Desired interface {
	// Populate returns the desired state of world, up to date (see
	// Populator.Populate).
	Populate() DesiredState
	// SetMounts makes mounts the configured mounts (see
	// Populator.SetMounts).
	SetMounts(mounts []*config.Mount) error
	// SetSources replaces the sources the mounts read.
	SetSources(sources map[string]source.Source)
	// WakeOnBuild makes f be called whenever the desired state changed
	// off the loop, so that the loop calls Populate again.
	WakeOnBuild(f func())
	// SetObserver makes o receive the desired state's events
	// (SourceEvent, HeldBackEvent), from Populate.
	SetObserver(o Observer)
}

// ChangeReporter is a Desired that says which mounts its last Populate
// changed, so that a pass of the reconciler plans those mounts alone
// (changes.go); the Populator and privsep.Remote are. A pass over a
// Desired that is not one plans every mount.
type ChangeReporter interface {
	// Changed calls f with the name of every mount whose desired mount
	// the last Populate call put anew into the map it returned, and
	// returns true. It returns false, without calling f, when that call
	// built the map anew (the first, or the first after SetMounts):
	// every mount counts as changed then, and mounts may have been added
	// or removed. A change a Releaser's Release makes is not reported:
	// the reconciler made it.
	Changed(f func(name string)) bool
}

// Releaser is a Desired that need not hold a payload once it is written:
// the monitor's (privsep.Remote), whose worker holds the snapshots the
// payload was built from and builds it again when asked. After a
// successful write — at once, or once a mount written in a burst has
// been idle (release.go) — the reconciler has the atomic writer forget
// the payload (projector.AtomicWriter.ForgetPayload) and releases it; a
// mount that needs it again — drift to repair — fetches it, and is
// rewritten once it comes.
type Releaser interface {
	// Release drops mount's payload of generation, written, and reports
	// whether it did; the desired mount stays ready (Released). digest is
	// the payload's (projector.Payload.Digest) as the atomic writer knows
	// it from the version's manifest, "" when it does not.
	Release(mount string, generation uint64, digest string) bool
	// Fetch asks for mount's released payload again at now; it comes as
	// a desired payload of the same generation when it is equal. It
	// returns when to ask again if it has not come by then, zero when
	// there is nothing to ask.
	Fetch(mount string, now time.Time) time.Time
	// OnDisk tells the Desired the digest (projector.Payload.Digest) of
	// the content each owned mount holds on disk, from its version's
	// manifest (projector.PeekDigest), by mount, once New has read them:
	// a payload found equal to it need not be sent, and comes as a
	// released desired mount of that Digest, which the reconciler keeps
	// without its bytes once the adoption confirms it.
	OnDisk(digests map[string]string)
	// Kept tells the Desired that mount's released desired state of
	// generation was kept as the version on disk holds it, without its
	// payload, and the bytes that version's files hold, read from its
	// manifest: the size to count for it (max_total_size) in place of
	// what was claimed.
	Kept(mount string, generation uint64, bytes int64)
}

// ReloadConfig is what a reload changes.
type ReloadConfig struct {
	// Mounts are the configured mounts (see Populator.SetMounts).
	Mounts []*config.Mount
	// Sources, when not nil, replace the source cache's sources in the same
	// step as Mounts, so that no pass ever sees mounts of one configuration
	// with sources of the other.
	Sources map[string]source.Source
	// ResyncInterval, when positive, replaces Options.ResyncInterval.
	ResyncInterval time.Duration
}

// New returns a reconciler whose actual state starts from owned: every
// recorded mount is taken as projected at an unknown generation, so that it
// is adopted (compared, not rewritten) when still configured and torn down
// when not. The digest of each one's content is read from its manifest's
// head (projector.PeekDigest), so that the mounts whose content changed
// while kvmount was not running are written first.
func New(pop Desired, owned *Owned, trigger Trigger, log *slog.Logger, opts Options) *Reconciler {
	if opts.ResyncInterval <= 0 {
		opts.ResyncInterval = config.DefaultResyncInterval
	}
	if opts.Observer == nil {
		opts.Observer = discardObserver{}
	}
	pop.SetObserver(opts.Observer)
	pop.WakeOnBuild(trigger.Fire)
	r := &Reconciler{
		log: log, pop: pop, owned: owned, trigger: trigger, opts: opts,
		asw:       NewActualState(),
		runtimes:  map[string]*runtime{},
		results:   make(chan result),
		execs:     newExecutors(),
		reloads:   make(chan reloadRequest),
		adopts:    make(chan adoptRequest),
		pings:     make(chan chan struct{}),
		running:   map[string]opClass{},
		kinds:     map[string]OpKind{},
		digests:   map[string]digestAt{},
		openFiles: openFileLimit(),
		procs:     newProcs(log),
		changes:   newChanges(),
		releasing: map[string]struct{}{},
	}
	var peeks errgroup.Group
	peeks.SetLimit(peekers)
	for name, rec := range owned.All() {
		a := &ActualMount{Dir: rec.Dir, Medium: rec.Medium}
		r.asw.Mounts[name] = a
		peeks.Go(func() error {
			a.DiskDigest, _ = projector.PeekDigest(rec.Dir, owned.ManifestDir(name))
			return nil
		})
	}
	peeks.Wait()
	if rel, ok := pop.(Releaser); ok {
		digests := make(map[string]string, len(r.asw.Mounts))
		for name, a := range r.asw.Mounts {
			if a.DiskDigest != "" {
				digests[name] = a.DiskDigest
			}
		}
		rel.OnDisk(digests)
	}
	r.opCtx, r.opCancel = context.WithCancel(context.Background())
	return r
}

// peekers is how many manifests' heads New reads at once.
const peekers = 8

// Reload applies cfg between two passes of the loop: sources and mounts
// together, then the resync interval. It returns once the loop has taken
// them, with Populator.SetMounts's error, or ctx's error.
func (r *Reconciler) Reload(ctx context.Context, cfg ReloadConfig) error {
	req := reloadRequest{cfg: cfg, done: make(chan error, 1)}
	return ask(ctx, r.reloads, req, req.done)
}

// ask hands req to the loop over ch and returns the error the loop sends
// back on done, or ctx's error if it ends first.
func ask[R any](ctx context.Context, ch chan<- R, req R, done <-chan error) error {
	select {
	case ch <- req:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// ErrNotConfigured is returned by Adopt for a mount that the configuration
// does not name.
var ErrNotConfigured = errors.New("no such mount in the configuration")

// Adopt makes the reconciler take the directory that mount's path reaches
// now for the mount's own, as at a first start: kvmount forgets what it
// recorded of the directory (its identity and marker), clears the mount's
// backoff and sets it up at once. The directory must then hold nothing but
// an atomic writer's layout (or nothing), else it is refused
// (projector.ErrForeignContent) and left as it is. It is the way out of
// fsutil.ErrUnrecognized, for an operator who knows that the directory is
// the mount's. It returns once the loop has taken the request, or with
// ctx's error; ErrNotConfigured for a mount not configured.
func (r *Reconciler) Adopt(ctx context.Context, mount string) error {
	req := adoptRequest{mount: mount, done: make(chan error, 1)}
	return ask(ctx, r.adopts, req, req.done)
}

// adopt carries out an Adopt request in the loop.
func (r *Reconciler) adopt(mount string) error {
	if !slices.Contains(r.names, mount) {
		return fmt.Errorf("mount %q: %w", mount, ErrNotConfigured)
	}
	if r.asw.InFlight[mount] {
		return fmt.Errorf("mount %q: an operation on it is under way; try again in a moment", mount)
	}
	if rt := r.runtimes[mount]; rt != nil && rt.writer != nil {
		// Opened anew, as a directory kvmount does not own yet.
		rt.writer.Close()
		rt.writer = nil
	}
	if err := r.forget(mount); err != nil {
		return err
	}
	r.changes.markAll()
	delete(r.asw.Failures, mount)
	if a := r.asw.Mounts[mount]; a != nil {
		a.RemountRequired = true
	}
	r.log.Warn("the directory the mount's path reaches is taken over as its own, on an operator's request", "mount", mount)
	return nil
}

// ErrNotRunning is returned by Ping when the loop is not running.
var ErrNotRunning = errors.New("reconciler loop not running")

// Ping returns nil once the reconciler's loop has answered — proof that
// it is alive and not stuck — or ctx's error. It is the heartbeat of
// /healthz and of systemd's watchdog. A loop that has stopped never
// answers.
func (r *Reconciler) Ping(ctx context.Context) error {
	pong := make(chan struct{})
	select {
	case r.pings <- pong:
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-pong:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// shutdown waits for the operations in flight, removes the versions kept
// for readers (a stopped kvmount leaves one version per mount) and closes
// every writer.
func (r *Reconciler) shutdown() {
	defer r.opCancel()
	defer r.execs.stop()
	for len(r.asw.InFlight) > 0 {
		select {
		case res := <-r.results:
			r.apply(res)
		case <-r.opts.Abort:
			r.log.Warn("stop forced: cutting short the operations in flight", "mounts", len(r.asw.InFlight))
			r.opCancel()
			r.opts.Abort = nil
		}
	}
	for name, rt := range r.runtimes {
		if rt.writer != nil {
			if err := rt.writer.RemoveReplaced(); err != nil {
				r.log.Warn("cannot remove replaced versions; the next start does", "mount", name, "err", err)
			}
			rt.writer.Close()
			rt.writer = nil
		}
	}
}

// dispatch starts op on an executor goroutine of its own (executors.go),
// whose result Run waits for.
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
	r.kinds[op.Mount] = op.Kind
	r.execs.run(func() {
		r.results <- r.execute(op, d, actual, rt)
	})
}

// apply records an operation's result in the actual state, logs it and
// tells the observer.
func (r *Reconciler) apply(res result) {
	name := res.op.Mount
	r.changes.mark(name) // planned on every pass while in flight; and after
	delete(r.asw.InFlight, name)
	delete(r.kinds, name)
	now := time.Now()
	r.finished(name, res.duration, now)
	if a := r.asw.Mounts[name]; a != nil && res.op.Kind != Teardown {
		a.CollectAt = res.collectAt
	}
	if res.opened && r.asw.Mounts[name] == nil {
		// Prepared (directory created, tmpfs mounted) even if the write
		// did not happen: the mount is kvmount's to tear down.
		r.asw.Mounts[name] = &ActualMount{Dir: res.spec.Dir, Medium: res.spec.Medium, Version: res.version, CollectAt: res.collectAt}
	}
	if errors.Is(res.err, projector.ErrNotKept) {
		// The version on disk is not the released payload's after all
		// (keep): its bytes are needed. The next pass asks for them.
		if a := r.asw.Mounts[name]; a != nil {
			a.DiskDigest = ""
		}
		r.log.Debug("the version on disk does not hold the payload; asking for it", "mount", name, "err", res.err)
		return
	}
	var held *HeldBackError
	if errors.As(res.err, &held) {
		r.asw.HeldBack[name] = &HeldBack{Generation: res.generation, Err: res.err}
		r.log.Warn("update held back; keeping last content", "mount", name, "revision", res.revision, "reason", held.Reason)
		r.opts.Observer.Observe(HeldBackEvent{Mount: name, Guard: held.Guard, Reason: held.Reason, Revision: res.revision, Time: now})
		return
	}
	if res.err != nil {
		f := r.asw.Failures[name]
		if f == nil {
			f = &Failure{}
			r.asw.Failures[name] = f
		}
		f.Count++
		delay := BackoffDelay(f.Count)
		f.NextRetry = now.Add(delay)
		f.Generation = res.generation
		f.Err = res.err
		f.PayloadCaused = payloadFailure(res.err)
		if a := r.asw.Mounts[name]; a != nil && res.drift != nil {
			a.RemountRequired = true
		}
		// The next attempt comes after the backoff; a failure of the
		// payload is tried again at the next change too.
		r.log.Error("operation failed; keeping last content", "mount", name, "op", res.op.Kind.String(), "attempt", f.Count, "retry_in", delay,
			"retry_on_change", f.PayloadCaused, "err", res.err)
		r.opts.Observer.Observe(FailedEvent{Mount: name, Op: res.op.Kind.String(), Err: res.err, Guard: guardOf(res.err), Attempt: f.Count, RetryIn: delay, RetryOnChange: f.PayloadCaused, Time: now})
		return
	}
	delete(r.asw.Failures, name)
	switch res.op.Kind {
	case Setup, Remount:
		delete(r.asw.HeldBack, name)
		a := r.asw.Mounts[name]
		if a == nil {
			a = &ActualMount{}
			r.asw.Mounts[name] = a
		}
		if a.Drift != nil {
			r.log.Warn("repaired drift", "mount", name, "drift", a.Drift, "duration", res.duration)
			if a.Generation == res.generation {
				// Put back as it was written, as a verification's
				// repair is: nothing changed for readers to be told of.
				res.change = projector.Change{}
			}
		}
		a.Dir, a.Medium, a.Generation, a.Version, a.RemountRequired, a.Drift = res.spec.Dir, res.spec.Medium, res.generation, res.version, false, nil
		a.CollectAt, a.PendingSince, a.DiskDigest = res.collectAt, time.Time{}, ""
		delete(r.digests, name)
		r.wrote(name, res.generation, now)
		if res.adoption.FromManifest {
			// Adopted without reading a byte: the background
			// verification reads them back.
			a.VerifyDue = true
		}
		if res.payload == nil {
			r.kept(name, res.generation, res.bytes)
		}
		if !res.change.Empty() {
			r.log.Info("projected", "mount", name, "revision", res.revision, "version", res.version,
				"added", len(res.change.Added), "changed", len(res.change.Changed), "removed", len(res.change.Removed),
				"duration", res.duration)
		}
		r.opts.Observer.Observe(ProjectedEvent{Mount: name, Dir: res.spec.Dir, Medium: res.spec.Medium, Op: res.op.Kind.String(),
			Revision: res.revision, Version: res.version, Change: res.change, Files: res.files, Bytes: res.bytes,
			Duration: res.duration, Time: now})
	case Teardown:
		a := r.asw.Mounts[name]
		delete(r.asw.Mounts, name)
		delete(r.releasing, name)
		delete(r.runtimes, name)
		delete(r.digests, name)
		if a != nil {
			r.log.Info("torn down", "mount", name, "dir", a.Dir)
			r.opts.Observer.Observe(TornDownEvent{Mount: name, Dir: a.Dir, Time: now})
		}
	case Verify:
		a := r.asw.Mounts[name]
		if a != nil {
			a.VerifyDue = false
			if !res.unrepaired {
				a.Version = res.version
			}
		}
		if res.unrepaired {
			// Its payload was released: fetched (pass), then remounted.
			if a != nil {
				a.RemountRequired, a.Drift = true, res.drift
			}
			r.log.Warn("drift found; asking for the payload again to repair it", "mount", name, "drift", res.drift)
			return
		}
		if res.drift != nil {
			r.log.Warn("repaired drift", "mount", name, "drift", res.drift, "duration", res.duration)
			r.opts.Observer.Observe(ProjectedEvent{Mount: name, Dir: res.spec.Dir, Medium: res.spec.Medium, Op: res.op.Kind.String(),
				Revision: res.revision, Version: res.version, Change: res.change, Files: len(res.payload), Bytes: res.payload.Size(),
				Duration: res.duration, Time: now})
		}
	}
}

// payloadFailure reports whether err, an operation's failure, is the
// payload's own — a new payload may not fail so — rather than the host's.
func payloadFailure(err error) bool {
	return errors.Is(err, projector.ErrCheckFailed) || errors.Is(err, errTooLarge) || errors.Is(err, projector.ErrInvalidPath)
}

// guardOf names the guard rail behind a failed write, if any.
func guardOf(err error) string {
	switch {
	case errors.Is(err, projector.ErrCheckFailed):
		return "check_command"
	case errors.Is(err, errTooLarge):
		return "size_limit"
	case errors.Is(err, fsutil.ErrUnrecognized):
		return "mount_dir_unrecognized"
	case errors.Is(err, fsutil.ErrReplaced) || errors.Is(err, fsutil.ErrSymlink) || errors.Is(err, fsutil.ErrNotDir):
		return "mount_dir_replaced"
	}
	return ""
}
