package projector

import (
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// Removing trees in a mount directory that someone else can write.
//
// A mount with a user (DirUID) is that user's to write: its directory, the
// version directories and the directories inside them are theirs. Whatever
// they put there — a directory moved in from elsewhere, holding files
// they could not delete — kvmount, running as root, must not delete with
// root's rights. So a tree in such a mount is removed with the file-system
// identity of whoever else can write there (fsutil.AsFSUser): the kernel
// then allows exactly what that user could do, and what they could not
// remove stays, reported. Only a directory that sits directly in the mount
// directory, is root's and is writable by root alone was put there by root
// (a user cannot move a directory they cannot write: rename needs it to
// update its ".."): kvmount's candidate versions; such a tree is removed
// as root, down to the first directory someone else can write.

// maxRemoveDepth bounds the depth of a tree kvmount removes: deeper
// directories, which no payload makes (a path is at most 4,096 bytes),
// stay, reported.
const maxRemoveDepth = 2048

// writerFSID returns the file-system identity whose rights removals in the
// mount directory take, and whether one applies: the mount's user (and
// group, else nogroup) when the directories are theirs; nobody with the
// mount's group when only group or others can write them; none (root's
// rights) when root alone can.
func (w *AtomicWriter) writerFSID() (uid, gid int, restricted bool) {
	const nobody = 65534
	gid = nobody
	if w.opts.DirGID >= 0 {
		gid = w.opts.DirGID
	}
	switch {
	case w.opts.DirUID >= 0 && w.opts.DirUID != w.uid:
		return w.opts.DirUID, gid, true
	case w.opts.DirMode.Perm()&0o022 != 0:
		return nobody, gid, true
	}
	return -1, -1, false
}

// removeTree removes the entry name of the directory parent and, for a
// directory, everything below it, with the rights the rules above give:
// root's where root alone can write, else those of whoever else can
// (writerFSID). The entry itself, once empty, goes with root's rights: an
// empty directory or a single name in a directory kvmount owns holds
// nothing of anyone's. A missing entry is no error; what those rights
// cannot remove stays and is reported (an error wrapping the system call's,
// EACCES or EPERM). atTop says that parent is the mount directory itself.
func (w *AtomicWriter) removeTree(parent *os.File, name string, atTop bool) error {
	uid, gid, restricted := w.writerFSID()
	if !restricted {
		return removeAt(int(parent.Fd()), name, maxRemoveDepth, nil)
	}
	var st unix.Stat_t
	switch err := unix.Fstatat(int(parent.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); {
	case errors.Is(err, unix.ENOENT):
		return nil
	case err != nil:
		return fmt.Errorf("atomic writer: remove %s: %w", name, err)
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return removeAt(int(parent.Fd()), name, 0, nil)
	}
	asWriter := func(dirfd int, name string, depth int) error {
		return fsutil.AsFSUser(uid, gid, func() error { return emptyDir(dirfd, name, depth, nil) })
	}
	var err error
	if atTop && rootsAlone(&st, w.uid) {
		// kvmount's own, below it root's until someone else's directory.
		err = emptyDir(int(parent.Fd()), name, maxRemoveDepth, func(dirfd int, name string, st *unix.Stat_t, depth int) (bool, error) {
			if rootsAlone(st, w.uid) {
				return false, nil
			}
			if err := asWriter(dirfd, name, depth); err != nil {
				return true, err
			}
			return true, rmdir(dirfd, name)
		})
	} else {
		err = asWriter(int(parent.Fd()), name, maxRemoveDepth)
	}
	if err != nil {
		return err
	}
	return rmdir(int(parent.Fd()), name)
}

// rootsAlone reports whether st is a directory owned by uid (kvmount's)
// that neither its group nor others can write.
func rootsAlone(st *unix.Stat_t, uid int) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFDIR && int(st.Uid) == uid && st.Mode&0o022 == 0
}

// removeAt removes the entry name of the directory dirfd and, for a
// directory, everything below it (emptyDir), depth levels deep at most.
func removeAt(dirfd int, name string, depth int, divert func(dirfd int, name string, st *unix.Stat_t, depth int) (bool, error)) error {
	err := unix.Unlinkat(dirfd, name, 0)
	switch {
	case err == nil, errors.Is(err, unix.ENOENT):
		return nil
	case !errors.Is(err, unix.EISDIR):
		return fmt.Errorf("atomic writer: remove %s: %w", name, err)
	}
	if err := emptyDir(dirfd, name, depth, divert); err != nil {
		return err
	}
	return rmdir(dirfd, name)
}

// rmdir removes the empty directory name of dirfd; a missing one is no
// error.
func rmdir(dirfd int, name string) error {
	if err := unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("atomic writer: remove %s: %w", name, err)
	}
	return nil
}

// emptyDir removes everything below the directory name of dirfd, depth
// levels deep at most, each directory opened relative to its parent
// without following a symlink. divert, when set, is asked first for each
// subdirectory (with its stat) whether it removes that subtree itself.
func emptyDir(dirfd int, name string, depth int, divert func(dirfd int, name string, st *unix.Stat_t, depth int) (bool, error)) error {
	if depth <= 0 {
		return fmt.Errorf("atomic writer: remove %s: deeper than %d directories: left in place", name, maxRemoveDepth)
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.ENOENT):
		return nil
	case err != nil:
		return fmt.Errorf("atomic writer: remove %s: %w", name, err)
	}
	d := os.NewFile(uintptr(fd), name)
	defer d.Close()
	names, err := d.Readdirnames(-1)
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	for _, sub := range names {
		if divert != nil {
			var st unix.Stat_t
			if unix.Fstatat(fd, sub, &st, unix.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR {
				if done, err := divert(fd, sub, &st, depth-1); done {
					errs = append(errs, err)
					continue
				}
			}
		}
		errs = append(errs, removeAt(fd, sub, depth-1, divert))
	}
	return errors.Join(errs...)
}
