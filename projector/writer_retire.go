package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// The replaced versions an atomic writer keeps for readers for a grace
// period (WriterOptions.Grace), and their removal.

// MaxRetired is how many replaced versions an AtomicWriter keeps at most
// for readers during their grace period; beyond it the oldest goes first.
// A reader descheduled in the middle of a path lookup can miss several
// back-to-back writes (measured: two kept versions still let 2 reads in
// 200,000 fail), so the bound is time (Grace) far more than count. A build
// that finds the file system full (ENOSPC) removes the replaced versions
// and is tried once more: a tmpfs sized for three versions never fails a
// write because of them. (Checking free space before each build instead
// cost 0.3 ms per write on ext4, measured: statfs is not cheap there.)
const MaxRetired = 16

// retiredVersion is a replaced version and when it was replaced.
type retiredVersion struct {
	*version
	at time.Time
}

// retire keeps previous as a version readers may still be in, then removes
// replaced versions whose grace period is over and, beyond MaxRetired, the
// oldest. dirs holds previous's directories open.
func (w *AtomicWriter) retire(previous *version, dirs dirHandles) error {
	now := time.Now()
	if previous != nil {
		w.retired = append(w.retired, retiredVersion{version: previous, at: now})
	}
	var errs []error
	for len(w.retired) > 0 && (len(w.retired) > MaxRetired || !now.Before(w.retired[0].at.Add(w.opts.Grace))) {
		v := w.dropOldest()
		h := dirHandles{}
		if v.version == previous {
			h = dirs
		}
		errs = append(errs, w.removeVersion(v.version, h))
	}
	return errors.Join(errs...)
}

// Collect removes the replaced versions whose grace period
// (WriterOptions.Grace) has passed at now. It returns when the next one
// will be due, or the zero time when none is kept.
func (w *AtomicWriter) Collect(now time.Time) (time.Time, error) {
	var errs []error
	for len(w.retired) > 0 && !now.Before(w.retired[0].at.Add(w.opts.Grace)) {
		v := w.dropOldest()
		errs = append(errs, w.removeVersion(v.version, dirHandles{}))
	}
	return w.CollectDue(), errors.Join(errs...)
}

// dropOldest takes the oldest replaced version out of w.retired and
// returns it. The slot it leaves is cleared (slices.Delete), not resliced
// past: a slice's backing array keeps every element alive, so a version
// resliced away — its payload, every file's bytes — stayed in memory
// until the mount's next write, at 1,000 mounts of 100 keys 15 MB of the
// monitor's heap after one update of each.
func (w *AtomicWriter) dropOldest() retiredVersion {
	v := w.retired[0]
	w.retired = slices.Delete(w.retired, 0, 1)
	return v
}

// RemoveReplaced removes every replaced version now, whatever its grace
// period: for a clean stop, which leaves one version per mount.
func (w *AtomicWriter) RemoveReplaced() error {
	var errs []error
	for _, v := range w.retired {
		errs = append(errs, w.removeVersion(v.version, dirHandles{}))
	}
	w.retired = nil
	return errors.Join(errs...)
}

// CollectDue returns when Collect will next remove a replaced version, or
// the zero time when none is kept.
func (w *AtomicWriter) CollectDue() time.Time {
	if len(w.retired) == 0 {
		return time.Time{}
	}
	return w.retired[0].at.Add(w.opts.Grace)
}

// removeVersion removes the version directory v, whose directories dirs
// holds open: each known file is unlinked relative to its directory's
// handle, then the directories, deepest first. Anything left over (a file
// added by hand) makes it fall back to removing the whole tree by path.
// Its manifest goes last.
func (w *AtomicWriter) removeVersion(v *version, dirs dirHandles) error {
	if err := w.removeVersionDir(v, dirs); err != nil {
		return err
	}
	if w.manifests != nil {
		if err := unix.Unlinkat(int(w.manifests.Fd()), manifestFile(v.name), 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("atomic writer: remove the manifest of %s: %w", v.name, err)
		}
	}
	return nil
}

// removeVersionDir is removeVersion's removal of the directory: by its
// known files where root alone can write the mount, else as a tree with
// the rights of whoever else can (removeTree).
func (w *AtomicWriter) removeVersionDir(v *version, dirs dirHandles) error {
	if _, _, restricted := w.writerFSID(); restricted {
		return w.removeAll(v.name)
	}
	if dirs["."] == nil {
		// Not held open by the caller: open it now.
		d, err := w.openVersion(v.name)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return w.removeAll(v.name)
		}
		dirs["."] = d
		defer dirs.close()
	}
	w.recall(v) // a forgotten version's files, from its manifest
	for _, p := range v.paths() {
		d := dirs.open(path.Dir(p))
		if d == nil {
			break
		}
		_ = unix.Unlinkat(int(d.Fd()), path.Base(p), 0)
	}
	clean := true
	_ = unix.Unlinkat(int(dirs["."].Fd()), legacyManifestName, 0)
	for _, dir := range slices.Backward(slices.Sorted(maps.Keys(v.dirs()))) {
		parent := dirs.open(path.Dir(dir))
		if parent == nil || unix.Unlinkat(int(parent.Fd()), path.Base(dir), unix.AT_REMOVEDIR) != nil {
			clean = false
			break
		}
	}
	if clean && unix.Unlinkat(int(w.mount.Fd()), v.name, unix.AT_REMOVEDIR) == nil {
		return nil
	}
	return w.removeAll(v.name)
}

// removeAll removes the version directory name and everything in it
// (removeTree).
func (w *AtomicWriter) removeAll(name string) error {
	if err := w.removeTree(w.mount, name, true); err != nil {
		return fmt.Errorf("atomic writer: remove previous version: %w", err)
	}
	return nil
}

// isRetired reports whether name is a replaced version kept for readers.
func (w *AtomicWriter) isRetired(name string) bool {
	for _, v := range w.retired {
		if v.name == name {
			return true
		}
	}
	return false
}
