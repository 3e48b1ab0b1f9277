// Package fsutil holds the few file-system operations kvmount performs on
// mount directories outside the atomic writer: opening a mount directory
// without following a symlink, creating it with its mode and owner, and
// mounting, recognising and unmounting the tmpfs of a mount whose medium is
// tmpfs.
//
// A mount directory is always reached through a handle opened relative to
// its parent with O_NOFOLLOW|O_DIRECTORY: whoever can write the parent can
// replace the mount directory with a symlink, and kvmount must then refuse
// it rather than change, mount over or remove what the symlink points at.
// The parent's own path is resolved as usual (/var/run → /run is common).
package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ErrNotDir is returned for a mount directory path that exists but is not a
// directory — a symlink to one included: a mount directory must be real.
var ErrNotDir = errors.New("not a directory")

// DirExists reports whether dir exists as a real directory, without
// following a symlink. It returns ErrNotDir (wrapped) for anything else at
// that path, and other errors from lstat(2) as they are.
func DirExists(dir string) (bool, error) {
	info, err := os.Lstat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, err
	case info.Mode().Type() == fs.ModeSymlink:
		return false, fmt.Errorf("%s: %w: it is a symlink, and kvmount never follows a symlink at a mount directory", dir, ErrNotDir)
	case !info.IsDir():
		return false, fmt.Errorf("%s: %w (%v)", dir, ErrNotDir, info.Mode().Type())
	}
	return true, nil
}

// OpenDir opens the directory dir for reading without following a symlink
// at its last element: the parent is opened first, then dir relative to it
// with O_NOFOLLOW|O_DIRECTORY. A symlink or anything else that is not a
// directory at dir yields an error wrapping ErrNotDir; a missing dir one
// wrapping fs.ErrNotExist. The caller closes the returned handle.
func OpenDir(dir string) (*os.File, error) {
	dir = filepath.Clean(dir)
	if !filepath.IsAbs(dir) || dir == "/" {
		return nil, fmt.Errorf("%s: a mount directory must be absolute and not /", dir)
	}
	parent, err := unix.Open(filepath.Dir(dir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: filepath.Dir(dir), Err: err}
	}
	defer unix.Close(parent)
	fd, err := unix.Openat(parent, filepath.Base(dir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR):
		// O_NOFOLLOW on a symlink gives ELOOP; with O_DIRECTORY some
		// kernels say ENOTDIR.
		var st unix.Stat_t
		kind := "not a directory"
		if unix.Fstatat(parent, filepath.Base(dir), &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
			kind = "a symlink"
		}
		return nil, fmt.Errorf("%s: %w: it is %s, and kvmount never follows a symlink at a mount directory", dir, ErrNotDir, kind)
	case err != nil:
		return nil, &fs.PathError{Op: "open", Path: dir, Err: err}
	}
	return os.NewFile(uintptr(fd), dir), nil
}

// ProcPath returns the /proc/self/fd path of the open file f: a path that
// names exactly the file f holds, for system calls that take only a path
// (mount(2)) or for os.OpenRoot. It is valid while f stays open.
func ProcPath(f *os.File) string {
	return fmt.Sprintf("/proc/self/fd/%d", f.Fd())
}

// SetDirAttrs gives the open directory d the permission mode and the owner
// uid:gid (-1 keeps the user or group), with fchmod(2) and fchown(2), so
// that a directory that was swapped for a symlink is never changed through
// it. What already matches is left alone: a chmod or chown to the same
// value still changes the inode (its ctime), and every start and reload
// sets every mount directory's attributes.
func SetDirAttrs(d *os.File, mode fs.FileMode, uid, gid int) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(d.Fd()), &st); err != nil {
		return &fs.PathError{Op: "fstat", Path: d.Name(), Err: err}
	}
	if fs.FileMode(st.Mode).Perm() != mode.Perm() || st.Mode&(unix.S_ISUID|unix.S_ISGID|unix.S_ISVTX) != 0 {
		if err := d.Chmod(mode.Perm()); err != nil {
			return err
		}
	}
	if (uid >= 0 && uint32(uid) != st.Uid) || (gid >= 0 && uint32(gid) != st.Gid) {
		if err := d.Chown(uid, gid); err != nil {
			return err
		}
	}
	return nil
}

// parentDirMode is the permission of the parents MakeDir creates: others
// must be able to reach the mount below them, whatever its own dir_mode.
const parentDirMode = 0o755

// MakeDir creates dir and any missing parents. Missing parents get mode
// 0755 and kvmount's own owner; dir itself gets mode and the owner uid:gid
// (-1 keeps kvmount's user or group). Every mode is set explicitly after
// mkdir(2), so the process umask never narrows it. The parent of each
// directory created is fsynced, so that the new entry survives a crash. An
// existing dir is left as it is; a symlink at dir is refused with ErrNotDir.
func MakeDir(dir string, mode fs.FileMode, uid, gid int) error {
	dir = filepath.Clean(dir)
	exists, err := DirExists(dir)
	if err != nil || exists {
		return err
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := MakeDir(parent, parentDirMode, -1, -1); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	d, err := OpenDir(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := SetDirAttrs(d, mode, uid, gid); err != nil {
		return err
	}
	return SyncDir(parent)
}

// SyncDir fsyncs the directory dir, making the entries created or removed
// in it durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}
