package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// The atomic writer's switch: ..data_tmp pointed at the version built and
// renamed over ..data, with the checks around it.

// switchTo makes name, the directory built, the current version:
// ..data_tmp is pointed at it and renamed over ..data. It reports whether
// the switch happened; an error with switched true means the rename took
// place but fsync of the mount directory failed.
//
// Just before the rename, name must still be the directory built: one that
// vanished (or was replaced) is never switched to. Just after, it is checked
// again; if it vanished in between, ..data is pointed back at the previous
// version and ErrVersionVanished returned.
func (w *AtomicWriter) switchTo(name string, built builtVersion) (switched bool, err error) {
	if err := w.isBuilt(name, built); err != nil {
		return false, err
	}
	if err := w.pointData(name); err != nil {
		return false, err
	}
	if err := w.isBuilt(name, built); err != nil {
		if w.current != nil {
			_ = w.pointData(w.current.name)
		}
		return false, err
	}
	if w.opts.Sync {
		if err := syncFile(w.mount); err != nil {
			return true, fmt.Errorf("atomic writer: fsync %s: %w", w.dir, err)
		}
	}
	return true, nil
}

// isBuilt checks that name, an entry of the mount directory, still is the
// directory built: the same device and inode, found by fstatat(2)
// relative to the writer's handle without following a symlink. It is one
// system call; os.Root.Lstat would make the same one after splitting the
// path and building an os.FileInfo, twice on each write's path.
func (w *AtomicWriter) isBuilt(name string, built builtVersion) error {
	var st unix.Stat_t
	err := unix.Fstatat(int(w.mount.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW)
	if err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR || st.Dev != built.dev || st.Ino != built.ident.Ino {
		return fmt.Errorf("atomic writer: %s: %w: %s (is another kvmount writing this mount?)", w.dir, ErrVersionVanished, name)
	}
	return nil
}

// pointData points ..data at name through ..data_tmp and a rename.
//
// The mount directory's entries are reached relative to the writer's
// handle with single names, so nothing is resolved through a symlink; the
// calls are unlinkat(2) and renameat(2) themselves, where os.Root.Remove
// would try rmdir after unlink failed for a missing ..data_tmp and
// os.Root.Rename would lstat ..data first: two system calls on each
// write's path that the kernel's own checks make needless (rename(2) of a
// symlink over a directory fails with EISDIR).
func (w *AtomicWriter) pointData(name string) error {
	err := w.symlinkDataTmp(name)
	if errors.Is(err, fs.ErrExist) {
		// Left by an earlier switch that did not finish: removed only
		// then, not before every switch, where it is one more system
		// call on each write's path that finds nothing.
		if err = w.removeDataTmp(); err == nil {
			err = w.symlinkDataTmp(name)
		}
	}
	if err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if w.opts.DirUID >= 0 || w.opts.DirGID >= 0 {
		if err := w.root.Lchown(dataTmpName, w.opts.DirUID, w.opts.DirGID); err != nil {
			_ = w.removeDataTmp()
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	if testHookBeforeRename != nil {
		testHookBeforeRename(w.dir)
	}
	if err := unix.Renameat(int(w.mount.Fd()), dataTmpName, int(w.mount.Fd()), DataDirName); err != nil {
		_ = w.removeDataTmp()
		return fmt.Errorf("atomic writer: %w", &os.LinkError{Op: "renameat", Old: dataTmpName, New: DataDirName, Err: err})
	}
	return nil
}

// symlinkDataTmp creates ..data_tmp in the mount directory, relative to
// the writer's handle, as a symlink to name: symlinkat(2) itself, which
// os.Root.Symlink makes after splitting the path. The error wraps
// fs.ErrExist when ..data_tmp is there.
func (w *AtomicWriter) symlinkDataTmp(name string) error {
	if err := unix.Symlinkat(name, int(w.mount.Fd()), dataTmpName); err != nil {
		return &fs.PathError{Op: "symlinkat", Path: dataTmpName, Err: err}
	}
	return nil
}

// removeDataTmp removes a ..data_tmp left by an earlier switch that did
// not finish (a crash between the symlink and the rename): a symlink, or a
// directory someone made; a missing one is no error.
func (w *AtomicWriter) removeDataTmp() error {
	err := unix.Unlinkat(int(w.mount.Fd()), dataTmpName, 0)
	if errors.Is(err, unix.EISDIR) { // unlink(2) of a directory, on Linux
		err = unix.Unlinkat(int(w.mount.Fd()), dataTmpName, unix.AT_REMOVEDIR)
	}
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("atomic writer: %w", &fs.PathError{Op: "unlinkat", Path: dataTmpName, Err: err})
	}
	return nil
}

// testHookBeforeRename, when set by a test, runs between creating
// ..data_tmp and renaming it over ..data.
var testHookBeforeRename func(dir string)

// syncFile fsyncs an open directory; a test replaces it to inject errors.
var syncFile = (*os.File).Sync
