// Package fsutil holds the few file-system operations kvmount performs on
// mount directories outside the atomic writer: creating a mount directory
// with its owner, checking what a path is, and mounting, recognising and
// unmounting the tmpfs of a mount whose medium is tmpfs.
package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ErrNotDir is returned by DirExists for a path that exists but is not a
// directory (a symlink to one included: a mount directory must be real).
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
	case !info.IsDir():
		return false, fmt.Errorf("%s: %w (%v)", dir, ErrNotDir, info.Mode().Type())
	}
	return true, nil
}

// MakeDir creates dir and any missing parents with mode (before umask) and
// gives dir itself — not the parents — the owner uid:gid; -1 keeps
// kvmount's own user or group.
func MakeDir(dir string, mode fs.FileMode, uid, gid int) error {
	if err := os.MkdirAll(dir, mode); err != nil {
		return err
	}
	if uid >= 0 || gid >= 0 {
		if err := os.Lchown(dir, uid, gid); err != nil {
			return err
		}
	}
	return nil
}

// tmpfsFlags are the mount flags of every tmpfs kvmount mounts: nothing on
// it can be a set-uid program, a device or an executable.
const tmpfsFlags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC

// TmpfsOptions describe a tmpfs mount.
type TmpfsOptions struct {
	// Size is the size limit in bytes (tmpfs rounds it up to whole pages).
	Size int64
	// Mode is the permission of the tmpfs's root directory.
	Mode fs.FileMode
	// UID and GID own the root directory; -1 means 0 (root), tmpfs's
	// default.
	UID, GID int
}

func (o TmpfsOptions) data() string {
	data := fmt.Sprintf("size=%d,mode=%04o", o.Size, o.Mode.Perm())
	if o.UID >= 0 {
		data += fmt.Sprintf(",uid=%d", o.UID)
	}
	if o.GID >= 0 {
		data += fmt.Sprintf(",gid=%d", o.GID)
	}
	return data
}

// IsTmpfsMount reports whether dir is the root of a tmpfs mount: a mount
// point (its device differs from its parent's) whose file system type is
// tmpfs. statfs alone is not enough: any directory under /run is on a
// tmpfs without being a mount point (kubelet, emptyDir medium Memory).
func IsTmpfsMount(dir string) (bool, error) {
	var st, parent unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return false, &fs.PathError{Op: "lstat", Path: dir, Err: err}
	}
	if err := unix.Lstat(filepath.Dir(dir), &parent); err != nil {
		return false, &fs.PathError{Op: "lstat", Path: filepath.Dir(dir), Err: err}
	}
	if st.Dev == parent.Dev {
		return false, nil
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		return false, &fs.PathError{Op: "statfs", Path: dir, Err: err}
	}
	return sfs.Type == unix.TMPFS_MAGIC, nil
}

// MountTmpfs mounts a tmpfs at dir with the options, nosuid, nodev and
// noexec. If dir already is a tmpfs mount it is remounted with the options
// instead — its content stays, and mounts are never stacked.
func MountTmpfs(dir string, o TmpfsOptions) error {
	mounted, err := IsTmpfsMount(dir)
	if err != nil {
		return err
	}
	flags := uintptr(tmpfsFlags)
	if mounted {
		flags |= unix.MS_REMOUNT
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", flags, o.data()); err != nil {
		return &fs.PathError{Op: "mount tmpfs", Path: dir, Err: err}
	}
	return nil
}

// UnmountTmpfs unmounts the tmpfs at dir, if dir is one. When the mount is
// busy (a process has a file open on it) it is detached instead (MNT_DETACH):
// it disappears from dir now and is freed when the last user closes it.
func UnmountTmpfs(dir string) error {
	mounted, err := IsTmpfsMount(dir)
	if err != nil || !mounted {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	err = unix.Unmount(dir, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(dir, unix.MNT_DETACH)
	}
	if err != nil {
		return &fs.PathError{Op: "unmount", Path: dir, Err: err}
	}
	return nil
}
