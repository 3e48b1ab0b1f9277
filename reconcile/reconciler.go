package reconcile

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"time"

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
	// Abort, when closed after Run's context is done, cuts short the
	// operations still running: a check_command is killed (the write it
	// guards fails and the mount keeps its content). Writes themselves are
	// short and always finish.
	Abort <-chan struct{}
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
	// opCtx is the context of operations' commands, cancelled by
	// Options.Abort.
	opCtx    context.Context
	opCancel context.CancelFunc
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
	op   Op
	spec *config.Mount
	// opened reports that the mount's directory is prepared and adopted
	// (its writer open), whatever became of the write.
	opened     bool
	generation uint64
	revision   string
	version    string
	collectAt  time.Time
	change     projector.Change
	drift      error
	err        error
	duration   time.Duration
}

type reloadRequest struct {
	cfg  ReloadConfig
	done chan error
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
	r.opCtx, r.opCancel = context.WithCancel(context.Background())
	return r
}

// Reload applies cfg between two passes of the loop: sources and mounts
// together, then the resync interval. It returns once the loop has taken
// them, with Populator.SetMounts's error, or ctx's error.
func (r *Reconciler) Reload(ctx context.Context, cfg ReloadConfig) error {
	req := reloadRequest{cfg: cfg, done: make(chan error, 1)}
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
			if req.cfg.Sources != nil {
				r.pop.SetSources(req.cfg.Sources)
			}
			err := r.pop.SetMounts(req.cfg.Mounts)
			if iv := req.cfg.ResyncInterval; err == nil && iv > 0 && iv != r.opts.ResyncInterval {
				r.opts.ResyncInterval = iv
				resync.Reset(iv)
			}
			req.done <- err
		}
	}
}

// shutdown waits for the operations in flight, removes the versions kept
// for readers (a stopped kvmount leaves one version per mount) and closes
// every writer.
func (r *Reconciler) shutdown() {
	defer r.opCancel()
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
		res.err = r.teardown(op.Mount, a, rt)
	case Verify:
		spec := rt.spec
		if d != nil {
			spec = d.Spec // a reload may have changed check_command, min_keys, ...
		}
		res.drift, res.err = r.verify(op.Mount, spec, rt)
	case Collect:
		if rt.writer != nil {
			_, res.err = rt.writer.Collect(time.Now())
		}
	}
	if rt.writer != nil {
		res.version = rt.writer.Version()
		res.collectAt = rt.writer.CollectDue()
		res.opened = op.Kind == Setup || op.Kind == Remount
	}
	res.duration = time.Since(start)
	return res
}

// project writes payload into the mount, opening (and adopting) its
// directory first if needed.
func (r *Reconciler) project(name string, spec *config.Mount, rt *runtime, payload projector.Payload) (projector.Change, error) {
	if rt.writer != nil && (rt.spec.UID != spec.UID || rt.spec.GID != spec.GID || rt.spec.DirMode != spec.DirMode || rt.spec.SizeLimit != spec.SizeLimit) {
		// The writer and the tmpfs carry the directories' owner and mode
		// and the size: open them anew.
		rt.writer.Close()
		rt.writer = nil
	}
	if spec.Medium == config.MediumTmpfs {
		if need := tmpfsBytes(payload); need > spec.SizeLimit {
			return projector.Change{}, fmt.Errorf("mount %q: the payload needs %d bytes of tmpfs (files round up to %d-byte pages), more than size_limit (%d bytes)", name, need, pageSize, spec.SizeLimit)
		}
	}
	if rt.writer == nil {
		if err := r.open(name, spec, rt); err != nil {
			return projector.Change{}, err
		}
	}
	if err := holdBack(spec, payload, rt.writer.Files()); err != nil {
		return projector.Change{}, err
	}
	rt.writer.SetCheck(checkCommand(r.opCtx, spec, r.log.With("mount", name)))
	change, err := rt.writer.Write(payload)
	if errors.Is(err, syscall.ENOSPC) {
		err = fmt.Errorf("%w (size_limit is %d bytes)", err, spec.SizeLimit)
	}
	if err != nil {
		return change, fmt.Errorf("mount %q: %w", name, err)
	}
	rt.written = payload
	return change, nil
}

// pageSize is the unit in which tmpfs allocates file data.
var pageSize = int64(os.Getpagesize())

// tmpfsBytes is the memory payload's files take on a tmpfs: each file's
// size rounded up to whole pages.
func tmpfsBytes(payload projector.Payload) int64 {
	var n int64
	for _, f := range payload {
		n += (int64(len(f.Data)) + pageSize - 1) / pageSize * pageSize
	}
	return n
}

// HeldBackError is a payload the mount's guard rails keep from replacing
// its content: fewer files than min_keys, or an empty payload over a
// non-empty mount without allow_empty. It is no failure: the mount waits
// for the next payload, reported stale.
type HeldBackError struct {
	Mount  string
	Reason string
}

// Error names the mount and says why its update was held back.
func (e *HeldBackError) Error() string {
	return fmt.Sprintf("mount %q: update held back: %s", e.Mount, e.Reason)
}

// holdBack returns a *HeldBackError when spec's guard rails refuse payload
// over a mount that holds files files.
func holdBack(spec *config.Mount, payload projector.Payload, files int) error {
	switch {
	case len(payload) < spec.MinKeys:
		return &HeldBackError{Mount: spec.Name, Reason: fmt.Sprintf("the payload has %d files, fewer than min_keys (%d)", len(payload), spec.MinKeys)}
	case len(payload) == 0 && files > 0 && !spec.AllowEmpty:
		return &HeldBackError{Mount: spec.Name, Reason: fmt.Sprintf("an empty payload would replace %d files; set allow_empty = true to allow it", files)}
	}
	return nil
}

// checkOutputLimit is how much of a check command's output is kept for the
// log, in bytes.
const checkOutputLimit = 4 << 10

// checkCommand returns the Check that runs spec's check_command against a
// new version directory ({{dir}} in an argument is its path; it also is the
// working directory), or nil without one, as check_user when set. The
// command fails the check by exiting non-zero or by outliving
// check_timeout. Its output, cut to 4 KiB, is logged at debug level only:
// a check may echo the secret values it reads.
//
// Cancelling ctx kills a running command.
func checkCommand(ctx context.Context, spec *config.Mount, log *slog.Logger) func(string) error {
	if len(spec.CheckCommand) == 0 {
		return nil
	}
	return func(dir string) error {
		args := make([]string, len(spec.CheckCommand))
		for i, a := range spec.CheckCommand {
			args[i] = strings.ReplaceAll(a, "{{dir}}", dir)
		}
		ctx, cancel := context.WithTimeout(ctx, spec.CheckTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, args[0], args[1:]...)
		cmd.Dir = dir
		if spec.CheckUID >= 0 {
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(spec.CheckUID), Gid: uint32(spec.CheckGID)}}
		}
		var out limitedBuffer
		out.limit = checkOutputLimit
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.WaitDelay = time.Second
		err := cmd.Run()
		switch {
		case errors.Is(ctx.Err(), context.DeadlineExceeded):
			err = fmt.Errorf("timed out after %v", spec.CheckTimeout)
		case ctx.Err() != nil:
			err = errors.New("killed: kvmount is stopping")
		}
		log.Debug("check_command finished", "command", args[0], "err", err, "output", strings.TrimSpace(out.String()))
		if err != nil {
			return fmt.Errorf("check_command %s: %w (its output is logged at debug level)", args[0], err)
		}
		return nil
	}
}

// limitedBuffer keeps the first limit bytes written to it.
type limitedBuffer struct {
	bytes.Buffer
	limit int
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := b.limit - b.Len(); room > 0 {
		b.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

// open prepares the mount directory — creating it, mounting its tmpfs,
// giving it the configured mode and owner — records the mount as owned and
// adopts what the directory holds. A directory or tmpfs kvmount is about to
// create is recorded first, so that a crash in between leaves nothing
// unowned. In a directory kvmount already owned, entries it did not make
// are drift: they are removed and logged. The mount directory is never
// reached through a symlink (fsutil.OpenDir).
func (r *Reconciler) open(name string, spec *config.Mount, rt *runtime) error {
	rec := Record{Dir: spec.Dir, Medium: spec.Medium}
	old, owned := r.owned.Get(name)
	owned = owned && old.Dir == spec.Dir
	if owned {
		rec.CreatedDir = old.CreatedDir
	}
	exists, err := fsutil.DirExists(spec.Dir)
	switch {
	case err != nil:
		return fmt.Errorf("mount %q: %w", name, err)
	case !exists:
		rec.CreatedDir = true
		if err := r.owned.Set(name, rec); err != nil {
			return err
		}
		if err := fsutil.MakeDir(spec.Dir, spec.DirMode, spec.UID, spec.GID); err != nil {
			return fmt.Errorf("mount %q: %w", name, err)
		}
	}
	if spec.Medium == config.MediumTmpfs {
		if err := r.mountTmpfs(name, spec, rec); err != nil {
			return err
		}
	}
	// A reload or restart may have changed the directory's mode or owner;
	// set them through a handle, never through a symlink.
	if err := setDirAttrs(spec); err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	w, err := projector.OpenAtomicWriter(spec.Dir, projector.WriterOptions{
		Sync:    spec.Medium == config.MediumDisk,
		DirMode: spec.DirMode,
		DirUID:  spec.UID,
		DirGID:  spec.GID,
	})
	if err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	if owned {
		removed, err := w.RemoveStrays()
		for _, entry := range removed {
			r.log.Warn("removed an entry kvmount did not write from its mount", "mount", name, "dir", spec.Dir, "entry", entry)
		}
		if err != nil {
			w.Close()
			return fmt.Errorf("mount %q: %w", name, err)
		}
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

// setDirAttrs gives the mount directory spec's dir_mode and owner.
func setDirAttrs(spec *config.Mount) error {
	d, err := fsutil.OpenDir(spec.Dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return fsutil.SetDirAttrs(d, spec.DirMode, spec.UID, spec.GID)
}

// TmpfsSize returns the size of the tmpfs of a mount whose payload may
// take sizeLimit bytes: three times sizeLimit — the current version, the
// version being built (every file changed) and a replaced version kept for
// readers — plus 1 MiB for the symlinks and directories of the layout.
// tmpfs counts pages that are used, so the size is a bound, not memory
// taken.
func TmpfsSize(sizeLimit int64) int64 {
	return 3*sizeLimit + 1<<20
}

// mountTmpfs mounts the mount's tmpfs, or remounts the one a previous run
// left (applying a new size, mode or owner, keeping the content). It
// refuses to hide files — a directory that is not yet a tmpfs must be
// empty — and never touches a file system kvmount did not mount there.
func (r *Reconciler) mountTmpfs(name string, spec *config.Mount, rec Record) error {
	state, err := fsutil.MountStateOf(spec.Dir)
	if err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	switch state {
	case fsutil.ForeignMount:
		return fmt.Errorf("mount %q: %s: %w; kvmount leaves it alone — unmount it or choose another dir", name, spec.Dir, fsutil.ErrForeignMount)
	case fsutil.NotMounted:
		entries, err := os.ReadDir(spec.Dir)
		if err != nil {
			return fmt.Errorf("mount %q: %w", name, err)
		}
		if len(entries) > 0 {
			return fmt.Errorf("mount %q: %s holds %s (and %d more): a tmpfs would hide it; empty the directory or choose another", name, spec.Dir, entries[0].Name(), len(entries)-1)
		}
		// Recorded before mounting: a crash right after leaves a tmpfs
		// kvmount knows to unmount.
		if err := r.owned.Set(name, rec); err != nil {
			return err
		}
	}
	err = fsutil.MountTmpfs(spec.Dir, fsutil.TmpfsOptions{Size: TmpfsSize(spec.SizeLimit), Mode: spec.DirMode, UID: spec.UID, GID: spec.GID})
	if err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	return nil
}

// teardown removes what kvmount wrote into the mount's directory, unmounts
// its tmpfs, removes the directory too if kvmount created it, and forgets
// the mount.
//
// A mount directory that has become a symlink is refused with an error:
// nothing behind it is read, removed or unmounted.
func (r *Reconciler) teardown(name string, a ActualMount, rt *runtime) error {
	dir := a.Dir
	rec, known := r.owned.Get(name)
	exists, err := fsutil.DirExists(dir)
	if err != nil {
		return fmt.Errorf("mount %q: refusing to tear down: %w; nothing behind it was touched", name, err)
	}
	if !exists {
		if rt.writer != nil {
			rt.writer.Close()
			rt.writer, rt.spec, rt.written = nil, nil, nil
		}
		return r.owned.Delete(name)
	}
	if rt.writer == nil {
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
	if a.Medium == config.MediumTmpfs {
		if err := fsutil.UnmountTmpfs(dir); err != nil {
			return fmt.Errorf("mount %q: %w", name, err)
		}
	}
	if known && rec.CreatedDir && rec.Dir == dir {
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			r.log.Warn("mount directory kept: it holds files kvmount did not write", "mount", name, "dir", dir, "err", err)
		}
	}
	return r.owned.Delete(name)
}

// verify compares the mount with the disk and, on drift, rewrites what was
// last written, with spec — the mount's current configuration, so that its
// current check_command and guard rails apply to the repair. It returns the
// drift found and the repair's error.
func (r *Reconciler) verify(name string, spec *config.Mount, rt *runtime) (drift, err error) {
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
	_, err = r.project(name, spec, rt, rt.written)
	return drift, err
}

// apply records an operation's result in the actual state and logs it.
func (r *Reconciler) apply(res result) {
	name := res.op.Mount
	delete(r.asw.InFlight, name)
	log := r.log.With("mount", name)
	if a := r.asw.Mounts[name]; a != nil && res.op.Kind != Teardown {
		a.CollectAt = res.collectAt
	}
	if res.opened && r.asw.Mounts[name] == nil {
		// Prepared (directory created, tmpfs mounted) even if the write
		// did not happen: the mount is kvmount's to tear down.
		r.asw.Mounts[name] = &ActualMount{Dir: res.spec.Dir, Medium: res.spec.Medium, Version: res.version, CollectAt: res.collectAt}
	}
	var held *HeldBackError
	if errors.As(res.err, &held) {
		r.asw.HeldBack[name] = &HeldBack{Generation: res.generation, Err: res.err}
		log.Warn("update held back; keeping last content", "revision", res.revision, "reason", held.Reason)
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
		delete(r.asw.HeldBack, name)
		a := r.asw.Mounts[name]
		if a == nil {
			a = &ActualMount{}
			r.asw.Mounts[name] = a
		}
		a.Dir, a.Medium, a.Generation, a.Version, a.RemountRequired = res.spec.Dir, res.spec.Medium, res.generation, res.version, false
		a.CollectAt = res.collectAt
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
		if hb := r.asw.HeldBack[name]; hb != nil && hb.Generation == d.Generation {
			st.Stale = append(slices.Clip(st.Stale), hb.Err)
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b MountStatus) int { return cmp.Compare(a.Name, b.Name) })
	return out
}
