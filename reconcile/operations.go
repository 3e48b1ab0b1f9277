package reconcile

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strings"
	"syscall"
	"time"

	"github.com/kvmount/kvmount/command"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/projector"
)

// The operations the reconciler's loop dispatches — set up, remount,
// verify, collect, tear down — as the kubelet's operation executor runs
// them beside its reconciler: each on its own goroutine, one at a time per
// mount, touching only that mount's runtime and the disk.

// runtime is what an operation needs beyond the ASW: the mount's open
// atomic writer and what it last wrote. Only the loop touches it, except
// while the mount's one operation runs.
type runtime struct {
	writer  *projector.AtomicWriter
	spec    *config.Mount
	written projector.Payload
	// adoption is how the last open took over the directory, until an
	// operation reports it.
	adoption projector.Adoption
	// released is set once written was dropped, its writer told to
	// forget it and the Desired to release it (Releaser): drift found
	// then is repaired by a remount once the payload is fetched.
	released bool
	// wroteAt is when the last write succeeded, and releaseAt when its
	// payload is to be released, zero when it is not to be (release.go).
	wroteAt, releaseAt time.Time
}

// result is what an operation reports to the loop.
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
	payload    projector.Payload
	// files and bytes are what the mount holds after a setup or a
	// remount: the payload's, or the version's kept (keep).
	files    int
	bytes    int64
	change   projector.Change
	adoption projector.Adoption
	drift    error
	// unrepaired is set when a verification found drift that it could
	// not repair for want of the payload, released (Releaser).
	unrepaired bool
	err        error
	duration   time.Duration
}

// errTooLarge marks a payload refused for a tmpfs mount's size_limit.
var errTooLarge = errors.New("payload too large")

// execute runs one operation. It touches only the mount's runtime and the
// disk.
func (r *Reconciler) execute(op Op, d *DesiredMount, a ActualMount, rt *runtime) result {
	start := time.Now()
	res := result{op: op}
	switch op.Kind {
	case Setup, Remount:
		res.spec, res.generation, res.revision, res.payload = d.Spec, d.Generation, d.Revision, d.Payload
		if d.Payload == nil {
			// Released, and the version on disk holds it (keepable).
			res.files, res.bytes, res.err = r.keep(op.Mount, d.Spec, rt, d.Digest)
			break
		}
		res.files, res.bytes = len(d.Payload), d.Payload.Size()
		res.change, res.err = r.project(op.Mount, d.Spec, rt, d.Payload)
	case Teardown:
		res.err = r.teardown(op.Mount, a, rt)
	case Verify:
		spec := rt.spec
		if d != nil {
			spec = d.Spec // a reload may have changed check_command, min_keys, ...
			res.revision = d.Revision
		}
		res.spec, res.payload = spec, rt.written
		res.drift, res.err = r.verify(op.Mount, spec, rt)
		res.unrepaired = res.drift != nil && res.err == nil && rt.written == nil
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
	res.adoption, rt.adoption = rt.adoption, projector.Adoption{}
	res.duration = time.Since(start)
	return res
}

// medium returns spec's medium.
func medium(spec *config.Mount) projector.Medium {
	return projector.Medium{Dir: spec.Dir, Tmpfs: spec.Medium == config.MediumTmpfs, SizeLimit: spec.SizeLimit, MaxFiles: spec.MaxFiles,
		Mode: spec.DirMode, UID: spec.UID, GID: spec.GID}
}

// project writes payload into the mount, opening (and adopting) its
// directory first if needed.
func (r *Reconciler) project(name string, spec *config.Mount, rt *runtime, payload projector.Payload) (projector.Change, error) {
	if rt.writer != nil && (rt.spec.UID != spec.UID || rt.spec.GID != spec.GID || rt.spec.DirMode != spec.DirMode || rt.spec.SizeLimit != spec.SizeLimit ||
		rt.spec.KeepReplaced != spec.KeepReplaced) {
		// The writer and the tmpfs carry the directories' owner and mode,
		// the size and the grace: open them anew.
		rt.writer.Close()
		rt.writer = nil
	}
	if err := medium(spec).CheckFits(payload); err != nil {
		return projector.Change{}, fmt.Errorf("mount %q: %w: %w", name, errTooLarge, err)
	}
	if rt.writer == nil {
		if err := r.open(name, spec, rt); err != nil {
			return projector.Change{}, err
		}
	}
	if err := holdBack(spec, len(payload), rt.writer.Files()); err != nil {
		return projector.Change{}, err
	}
	rt.writer.SetCheck(checkCommand(r.opCtx, spec, r.log), spec.CheckUID)
	change, err := rt.writer.Write(payload)
	if errors.Is(err, syscall.ENOSPC) {
		err = fmt.Errorf("%w (size_limit is %d bytes)", err, spec.SizeLimit)
	}
	if errors.Is(err, fsutil.ErrReplaced) {
		// Its path reaches another directory now: the next attempt opens
		// it anew, and Prepare decides what to make of what is there.
		rt.writer.Close()
		rt.writer = nil
	}
	if err != nil {
		return change, fmt.Errorf("mount %q: %w", name, err)
	}
	rt.written, rt.released = payload, false
	return change, nil
}

// HeldBackError is a payload the mount's guard rails keep from replacing
// its content: fewer files than min_keys, or an empty payload over a
// non-empty mount without allow_empty. It is no failure: the mount waits
// for the next payload, reported stale.
type HeldBackError struct {
	Mount string
	// Guard is "min_keys" or "allow_empty".
	Guard  string
	Reason string
}

// Error names the mount and says why its update was held back.
func (e *HeldBackError) Error() string {
	return fmt.Sprintf("mount %q: update held back: %s", e.Mount, e.Reason)
}

// holdBack returns a *HeldBackError when spec's guard rails refuse a
// payload of n files over a mount that holds files files.
func holdBack(spec *config.Mount, n, files int) error {
	switch {
	case n < spec.MinKeys:
		return &HeldBackError{Mount: spec.Name, Guard: "min_keys", Reason: fmt.Sprintf("the payload has %d files, fewer than min_keys (%d)", n, spec.MinKeys)}
	case n == 0 && files > 0 && !spec.AllowEmpty:
		return &HeldBackError{Mount: spec.Name, Guard: "allow_empty", Reason: fmt.Sprintf("an empty payload would replace %d files; set allow_empty = true to allow it", files)}
	}
	return nil
}

// checkCommand returns the Check that runs spec's check_command against a
// new version, or nil without one, as check_user (by default the mount's
// user, else nobody: config.Mount.CheckUID), in "/" and a clean environment
// (command.Spec.ResetEnv) with KVMOUNT_MOUNT and KVMOUNT_DIR: a check
// interprets what a store writer chose, and reaches it only through {{dir}}
// and KVMOUNT_DIR, never through its working directory.
//
// Where a private mount namespace can be made (command.NamespaceViews),
// the command runs in one in which the mount's own path shows the new
// version, read-only: {{dir}} in an argument and KVMOUNT_DIR are the
// mount's path, and a program whose stock configuration includes the
// mount (nginx -t) tests the new content. Elsewhere they are the new
// version directory's path, and only what the command reaches through them
// is the new content.
//
// The command fails the check by exiting non-zero or by outliving
// check_timeout: a *CheckError, which carries the last lines of its output
// (command.Tail, at most CheckOutputLimit bytes, escaped) when
// show_check_output is on — by default on disk, not on tmpfs, where a
// check may echo the secrets it reads; the first 4 KiB are logged at debug
// level, on log with the mount's name. Cancelling ctx kills a running
// command. A mount without a check costs nothing here: no logger is
// derived for it on each write.
func checkCommand(ctx context.Context, spec *config.Mount, log *slog.Logger) func(projector.Candidate) error {
	if len(spec.CheckCommand) == 0 {
		return nil
	}
	log = log.With("mount", spec.Name)
	return func(c projector.Candidate) error {
		viewErr := command.NamespaceViews()
		dir := c.MountDir
		if viewErr != nil {
			dir = c.Path()
		}
		args := make([]string, len(spec.CheckCommand))
		for i, a := range spec.CheckCommand {
			args[i] = strings.ReplaceAll(a, "{{dir}}", dir)
		}
		s := command.Spec{Argv: args, Timeout: spec.CheckTimeout, UID: spec.CheckUID, GID: spec.CheckGID,
			ResetEnv: true, Env: []string{"KVMOUNT_MOUNT=" + spec.Name, "KVMOUNT_DIR=" + dir}}
		var out string
		var err error
		if viewErr == nil {
			out, err = command.RunInView(ctx, s, command.View{MountDir: c.MountDir, Mount: c.Mount, Version: c.Version, VersionIdent: c.VersionIdent})
		} else {
			out, err = command.Run(ctx, s)
		}
		log.Debug("check_command finished", "command", args[0], "err", err, "output", out)
		if err == nil {
			return nil
		}
		ce := &CheckError{Program: args[0], Err: err, Hidden: !spec.ShowCheckOutput}
		if spec.ShowCheckOutput {
			ce.Output = command.Tail(out, CheckOutputLimit)
		}
		return ce
	}
}

// CheckError is a check_command's refusal of a new version: the program,
// why it failed (its exit status, a timeout) and the last lines of its
// output when the mount shows them.
type CheckError struct {
	Program string
	Err     error
	// Output is the last lines of the command's output (command.Tail),
	// escaped; "" when it printed nothing or Hidden is set.
	Output string
	// Hidden reports that the mount does not show check output
	// (show_check_output = false).
	Hidden bool
}

// Error names the program and why it failed, with its output or a word
// on why there is none. The text goes to the log, /status and kvmount
// status, which root alone reads; not to systemd's STATUS= (see Brief).
func (e *CheckError) Error() string {
	switch {
	case e.Hidden:
		return fmt.Sprintf("check_command %s: %v (its output is not shown for this mount, show_check_output = false; it is logged at debug level)", e.Program, e.Err)
	case e.Output == "":
		return fmt.Sprintf("check_command %s: %v (no output)", e.Program, e.Err)
	}
	return fmt.Sprintf("check_command %s: %v: %s", e.Program, e.Err, e.Output)
}

// Unwrap returns why the command failed.
func (e *CheckError) Unwrap() error { return e.Err }

// Brief is Error without the command's output: for systemd's STATUS=,
// which systemctl status shows to every local user — a check may print
// what only its user can read.
func (e *CheckError) Brief() string {
	return fmt.Sprintf("check_command %s: %v (its output: kvmount status)", e.Program, e.Err)
}

// CheckOutputLimit is how much of a failed check_command's output its
// error carries, in bytes: the last lines, to the log, /status, kvmount
// status and systemd's status line.
const CheckOutputLimit = 256

// open prepares the mount directory (projector.Medium: creating it,
// mounting its tmpfs, giving it the configured mode and owner), records the
// mount as owned and adopts what the directory holds. A directory or tmpfs
// kvmount is about to create is recorded first, so that a crash in between
// leaves nothing unowned. In a directory kvmount already owned, entries it
// did not make are drift: they are removed and logged. A path that now
// reaches another directory than the one recorded is refused
// (fsutil.ErrReplaced): kvmount never takes over whatever a user who can
// write a parent put there.
func (r *Reconciler) open(name string, spec *config.Mount, rt *runtime) error {
	rec := Record{Dir: spec.Dir, Medium: spec.Medium}
	old, owned := r.owned.Get(name)
	owned = owned && old.Dir == spec.Dir && old.Medium == spec.Medium
	var owner projector.Owner
	if owned {
		rec.CreatedDir, owner = old.CreatedDir, old.owner()
		rec.Ident, rec.TmpfsIdent, rec.Marker = old.Ident, old.TmpfsIdent, old.Marker
	}
	marker := owner.Marker
	if marker == "" {
		// Recorded once the directory has it: a record that names a
		// marker the directory lacks would refuse it.
		var err error
		if marker, err = fsutil.NewMarker(); err != nil {
			return fmt.Errorf("mount %q: %w", name, err)
		}
	}
	md, err := medium(spec).Prepare(owner, marker, func(createDir bool) error {
		rec.CreatedDir = rec.CreatedDir || createDir
		return r.owned.Set(name, rec)
	})
	if errors.Is(err, fsutil.ErrReplaced) {
		return fmt.Errorf("mount %q: %w; if it is this mount's directory (a remount renumbered its file system, or you put it there), take it over with: kvmount adopt -mount %s", name, err, name)
	}
	if err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	defer md.File.Close()
	if md.Readopted {
		r.log.Warn("mount directory taken back: its file system keeps no marker and was renumbered (a remount or reboot), and only root could have put it at its path",
			"mount", name, "dir", spec.Dir)
	}
	rec.Ident, rec.TmpfsIdent, rec.Marker = md.Owner.Dir, md.Owner.Tmpfs, md.Owner.Marker
	// A tmpfs mount keeps no manifest: the hashes of its files (secrets,
	// mostly) would reach the disk, where the files never do. Its
	// adoption reads the files, from memory.
	manifests := ""
	if spec.Medium == config.MediumDisk {
		if manifests, err = r.owned.MakeManifestDir(name); err != nil {
			return fmt.Errorf("mount %q: %w", name, err)
		}
	}
	w, err := projector.OpenAtomicWriterAt(spec.Dir, md.File, projector.WriterOptions{
		Sync:        spec.Medium == config.MediumDisk,
		DirMode:     spec.DirMode,
		DirUID:      spec.UID,
		DirGID:      spec.GID,
		Grace:       spec.KeepReplaced,
		ManifestDir: manifests,
		MaxFileSize: spec.MaxValueSize,
		MaxFiles:    spec.MaxFiles,
	})
	if err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	adopt := w.Adopt
	if owned {
		adopt = w.AdoptOwned
	}
	ad, err := adopt()
	for _, entry := range ad.Removed {
		r.log.Warn("removed an entry kvmount did not write from its mount", "mount", name, "dir", spec.Dir, "entry", entry)
	}
	if len(ad.Left) > 0 {
		r.log.Warn("left entries kvmount did not write in its mount: the mount's user could not remove them, so kvmount does not", "mount", name, "dir", spec.Dir, "entries", ad.Left, "err", ad.LeftErr)
	}
	if err != nil {
		w.Close()
		return fmt.Errorf("mount %q: %w", name, err)
	}
	switch {
	case errors.Is(ad.ManifestErr, projector.ErrDrift):
		r.log.Warn("the manifest of the version on disk does not match it: adopted by reading every file, and what differs is written again", "mount", name, "version", ad.Version, "drift", ad.ManifestErr)
	case ad.Version != "":
		r.log.Debug("adopted the version on disk", "mount", name, "version", ad.Version, "files", ad.Files, "from_manifest", ad.FromManifest, "manifest_err", ad.ManifestErr)
	}
	rt.adoption = ad
	if err := r.owned.Set(name, rec); err != nil {
		w.Close()
		return err
	}
	rt.writer, rt.spec = w, spec
	return nil
}

// teardown removes what kvmount wrote into the mount's directory, unmounts
// its tmpfs, removes the directory too if kvmount created it, and forgets
// the mount.
//
// The directory is reached without following a symlink in any component
// and must be the one recorded: a symlink, or another directory where the
// mount was (someone who can write a parent replaced it), is left
// untouched — nothing behind it is read, removed or unmounted — and the
// mount is forgotten with a warning, since nothing kvmount wrote is
// reachable there.
func (r *Reconciler) teardown(name string, a ActualMount, rt *runtime) error {
	dir := a.Dir
	rec, known := r.owned.Get(name)
	if !known || rec.Dir != dir {
		rec = Record{Dir: dir, Medium: a.Medium}
	}
	closeWriter := func() {
		if rt.writer != nil {
			rt.writer.Close()
			rt.writer, rt.spec, rt.written, rt.released = nil, nil, nil, false
		}
	}
	m := projector.Medium{Dir: dir, Tmpfs: a.Medium == config.MediumTmpfs}
	d, err := m.Open(rec.owner())
	switch {
	case errors.Is(err, fs.ErrNotExist):
		closeWriter()
		return r.forget(name)
	case errors.Is(err, fsutil.ErrReplaced) || errors.Is(err, fsutil.ErrSymlink) || errors.Is(err, fsutil.ErrNotDir):
		closeWriter()
		r.log.Warn("mount directory replaced by someone else: left untouched, and the mount forgotten", "mount", name, "dir", dir, "err", err)
		return r.forget(name)
	case err != nil:
		return fmt.Errorf("mount %q: refusing to tear down: %w", name, err)
	}
	closeWriter()
	// Without its manifests, which forget removes.
	w, err := projector.OpenAtomicWriterAt(dir, d, projector.WriterOptions{DirUID: -1, DirGID: -1})
	d.Close()
	if err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	rt.writer = w
	if err := rt.writer.Teardown(); err != nil {
		return fmt.Errorf("mount %q: %w", name, err)
	}
	if left, why := rt.writer.Left(); len(left) > 0 {
		r.log.Warn("left versions in the mount at teardown: the mount's user could not remove what they hold, so kvmount does not", "mount", name, "dir", dir, "entries", left, "err", why)
	}
	closeWriter()
	err = m.Release(rec.owner(), known && rec.CreatedDir && rec.Dir == dir)
	switch {
	case errors.Is(err, projector.ErrDirKept):
		r.log.Warn("mount directory kept: it holds files kvmount did not write", "mount", name, "dir", dir, "err", err)
	case err != nil:
		return fmt.Errorf("mount %q: %w", name, err)
	}
	return r.forget(name)
}

// forget removes what kvmount keeps of a mount in its state directory:
// its manifests and its record.
func (r *Reconciler) forget(name string) error {
	if err := r.owned.RemoveManifestDir(name); err != nil {
		return err
	}
	return r.owned.Delete(name)
}

// verify compares the mount with the disk and, on drift, rewrites what was
// last written, with spec — the mount's current configuration, so that its
// current check_command and guard rails apply to the repair. It returns the
// drift found and the repair's error.
//
// A released payload (Releaser) is not at hand: the writer compares the
// disk with the hashes of the version's manifest, and drift found is
// returned unrepaired (the loop fetches the payload and remounts).
func (r *Reconciler) verify(name string, spec *config.Mount, rt *runtime) (drift, err error) {
	if rt.writer == nil || rt.written == nil && !rt.released {
		return nil, nil // adopted, not yet compared: the next remount does
	}
	drift = rt.writer.Verify()
	if drift == nil {
		if rt.released {
			rt.writer.ForgetPayload() // what Verify read to compare
		}
		return nil, nil
	}
	if !errors.Is(drift, projector.ErrDrift) {
		return nil, fmt.Errorf("mount %q: %w", name, drift)
	}
	// Reopen: the directory itself may have been removed or replaced.
	rt.writer.Close()
	rt.writer = nil
	if rt.written == nil {
		return drift, nil
	}
	_, err = r.project(name, spec, rt, rt.written)
	return drift, err
}
