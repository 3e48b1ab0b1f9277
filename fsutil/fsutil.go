// Package fsutil holds the file-system operations kvmount performs outside
// the atomic writer: resolving a path with no symlink in any component,
// creating a mount directory and its parents, identifying a directory by
// file system and inode, stripping inherited POSIX ACLs, and mounting,
// recognising and unmounting the tmpfs of a mount whose medium is tmpfs.
//
// kvmount runs as root on hosts shared with service accounts, and a path
// it is given may pass through directories those accounts can write. Every
// path below / that kvmount creates, opens, changes or removes is therefore
// resolved without following a symlink in any component — openat2(2) with
// RESOLVE_NO_SYMLINKS, or on a kernel without it a component-wise
// O_NOFOLLOW walk from / — and then used through the handle it yields
// (fchmod, fchown, mkdirat, ...), never through the path again. This closes
// the class of CVE-2018-6954 (systemd-tmpfiles followed symlinks in
// non-terminal components) and the kubelet's subpath CVE-2017-1002101.
package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/untrusted"
)

// ErrNotDir is returned for a path that exists but is not a directory — a
// symlink to one included: a mount directory must be real.
var ErrNotDir = errors.New("not a directory")

// ErrSymlink is returned for a path one of whose components is a symlink:
// kvmount follows none. The error names the component.
var ErrSymlink = errors.New("a symlink in the path")

// resolveFlags are openat2's resolve flags for every path kvmount opens:
// no symlink, and no /proc magic link, in any component.
const resolveFlags = unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// noOpenat2 is set when the kernel (before Linux 5.6) or a seccomp filter
// refuses openat2; the component-wise walk is used then.
var noOpenat2 atomic.Bool

// OpenNoFollow opens the absolute path with flags (O_RDONLY, O_DIRECTORY,
// O_PATH, ...; O_CLOEXEC and O_NOFOLLOW are added) without following a
// symlink in any component: openat2(2) with RESOLVE_NO_SYMLINKS where the
// kernel has it, else a walk from / that opens each component relative to
// the previous one with O_NOFOLLOW. The path is cleaned first; it must be
// absolute.
//
// A symlink in any component yields an error wrapping ErrSymlink that names
// it (and, at the last component, ErrNotDir too when flags ask for a
// directory); a missing component one wrapping fs.ErrNotExist; others are
// *fs.PathError. The caller closes the returned handle.
func OpenNoFollow(path string, flags int) (*os.File, error) {
	path = filepath.Clean(path)
	if !filepath.IsAbs(path) {
		return nil, fmt.Errorf("%s: not an absolute path", path)
	}
	flags |= unix.O_CLOEXEC | unix.O_NOFOLLOW
	fd, err := openNoFollow(path, flags)
	if err != nil {
		return nil, noFollowError(path, flags, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// noFollowError returns OpenNoFollow's error for path, opened with flags,
// from err, the error of the open itself.
func noFollowError(path string, flags int, err error) error {
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
		if link := firstSymlink(path); link != "" {
			target, _ := os.Readlink(link)
			target = untrusted.Escape(target) // chosen by whoever can write the directory
			wrapped := ErrSymlink
			if link == path && flags&unix.O_DIRECTORY != 0 {
				return fmt.Errorf("%s: %w: %w: it is a symlink (to %s), and kvmount never follows a symlink at a mount directory", path, ErrNotDir, wrapped, target)
			}
			if link == path {
				return fmt.Errorf("%s: %w: it is a symlink (to %s), and kvmount follows none", path, wrapped, target)
			}
			return fmt.Errorf("%s: %w: %s is a symlink (to %s), and kvmount follows no symlink in any component of a path; name the directory without it", path, wrapped, link, target)
		}
		if errors.Is(err, unix.ENOTDIR) && flags&unix.O_DIRECTORY != 0 {
			return fmt.Errorf("%s: %w", path, ErrNotDir)
		}
	}
	return &fs.PathError{Op: "open", Path: path, Err: err}
}

// openNoFollow opens path with openat2, or walks it.
func openNoFollow(path string, flags int) (int, error) {
	if !noOpenat2.Load() {
		fd, err := unix.Openat2(unix.AT_FDCWD, path, &unix.OpenHow{Flags: uint64(flags), Resolve: resolveFlags})
		if err == nil {
			return fd, nil
		}
		if !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EPERM) {
			// EAGAIN: a rename raced the lookup (RESOLVE_NO_SYMLINKS
			// may refuse to retry); walk instead.
			if !errors.Is(err, unix.EAGAIN) {
				return -1, err
			}
		} else {
			noOpenat2.Store(true)
		}
	}
	return walk(path, flags)
}

// walk opens path component by component from /, each relative to the
// previous one with O_NOFOLLOW.
func walk(path string, flags int) (int, error) {
	dir, err := unix.Open("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if path == "/" {
		if flags&unix.O_PATH != 0 {
			return dir, nil
		}
		defer unix.Close(dir)
		return unix.Openat(dir, ".", flags, 0)
	}
	elems := strings.Split(strings.TrimPrefix(path, "/"), "/")
	for i, elem := range elems {
		f := unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC
		if i == len(elems)-1 {
			f = flags
		}
		next, err := unix.Openat(dir, elem, f, 0)
		unix.Close(dir)
		if err != nil {
			return -1, err
		}
		dir = next
	}
	return dir, nil
}

// firstSymlink returns the first component of the absolute, clean path that
// is a symlink, or "".
func firstSymlink(path string) string {
	p := "/"
	for elem := range strings.SplitSeq(strings.TrimPrefix(path, "/"), "/") {
		p = filepath.Join(p, elem)
		info, err := os.Lstat(p)
		if err != nil {
			return ""
		}
		if info.Mode().Type() == fs.ModeSymlink {
			return p
		}
	}
	return ""
}

// OpenDir opens the directory dir for reading without following a symlink
// in any component (OpenNoFollow). A symlink or anything else that is not a
// directory at dir yields an error wrapping ErrNotDir; a symlink in a parent
// one wrapping ErrSymlink; a missing dir one wrapping fs.ErrNotExist. The
// caller closes the returned handle.
func OpenDir(dir string) (*os.File, error) {
	dir, err := cleanMountDir(dir)
	if err != nil {
		return nil, err
	}
	return OpenNoFollow(dir, unix.O_RDONLY|unix.O_DIRECTORY)
}

// cleanMountDir returns dir cleaned, or an error when it is not absolute
// or is /.
func cleanMountDir(dir string) (string, error) {
	dir = filepath.Clean(dir)
	if !filepath.IsAbs(dir) || dir == "/" {
		return "", fmt.Errorf("%s: a mount directory must be absolute and not /", dir)
	}
	return dir, nil
}

// StatDir returns the fstat(2) of the directory at dir, reached as OpenDir
// reaches it (no symlink in any component), on a descriptor it closes
// again: a check of what a path reaches, made on every write of a mount,
// without an *os.File, whose making asks the kernel for the descriptor's
// flags (fcntl(2) F_GETFL). Its errors are OpenDir's, and an fstat's
// *fs.PathError.
func StatDir(dir string) (unix.Stat_t, error) {
	dir, err := cleanMountDir(dir)
	if err != nil {
		return unix.Stat_t{}, err
	}
	const flags = unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC | unix.O_NOFOLLOW
	fd, err := openNoFollow(dir, flags)
	if err != nil {
		return unix.Stat_t{}, noFollowError(dir, flags, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return unix.Stat_t{}, &fs.PathError{Op: "fstat", Path: dir, Err: err}
	}
	return st, nil
}

// DirExists reports whether dir exists as a real directory reached without
// following a symlink in any component. It returns ErrNotDir (wrapped) for
// anything else at that path, ErrSymlink for a symlink in a parent, and
// other errors of the lookup as they are.
func DirExists(dir string) (bool, error) {
	d, err := OpenDir(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, err
	}
	d.Close()
	return true, nil
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
// sets every mount directory's attributes. Set-user-ID, set-group-ID and
// sticky bits are cleared.
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

// MakeDir creates dir and any missing parents, without following a symlink
// in any component: each directory is opened relative to its parent with
// O_NOFOLLOW and created with mkdirat(2). Missing parents get mode 0755 and
// kvmount's own owner; dir itself gets mode and the owner uid:gid (-1 keeps
// kvmount's user or group). Every mode is set explicitly with fchmod(2)
// after mkdirat(2), so the process umask never narrows it, and no POSIX ACL
// a parent's default ACL would pass on is left on what it creates. The
// parent of each directory created is fsynced, so that the new entry
// survives a crash.
//
// It returns dir open (O_RDONLY|O_DIRECTORY) and whether it created dir.
// An existing dir is returned as it is, its attributes unchanged. A symlink
// in any component is refused (ErrSymlink; ErrNotDir at dir itself).
func MakeDir(dir string, mode fs.FileMode, uid, gid int) (*os.File, bool, error) {
	dir = filepath.Clean(dir)
	d, err := OpenDir(dir)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return d, false, err
	}
	parentPath, name := filepath.Split(dir)
	parentPath = filepath.Clean(parentPath)
	var parent *os.File
	if parentPath == "/" {
		parent, err = OpenNoFollow("/", unix.O_RDONLY|unix.O_DIRECTORY)
	} else {
		parent, _, err = MakeDir(parentPath, parentDirMode, -1, -1)
	}
	if err != nil {
		return nil, false, err
	}
	defer parent.Close()
	d, created, err := MakeDirAt(parent, name, mode, uid, gid)
	if err != nil {
		return nil, false, fmt.Errorf("%s: %w", dir, err)
	}
	return d, created, nil
}

// MakeDirAt creates the directory name in the open directory parent with
// mode and owner (as MakeDir), fsyncs parent, and returns it open; an
// existing directory is opened and returned as it is. name is one path
// element; a symlink there is refused (ErrNotDir).
func MakeDirAt(parent *os.File, name string, mode fs.FileMode, uid, gid int) (*os.File, bool, error) {
	created := true
	if err := unix.Mkdirat(int(parent.Fd()), name, 0o700); errors.Is(err, unix.EEXIST) {
		created = false
	} else if err != nil {
		return nil, false, &fs.PathError{Op: "mkdir", Path: name, Err: err}
	}
	fd, err := unix.Openat(int(parent.Fd()), name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
		return nil, false, fmt.Errorf("%s: %w", name, ErrNotDir)
	}
	if err != nil {
		return nil, false, &fs.PathError{Op: "open", Path: name, Err: err}
	}
	d := os.NewFile(uintptr(fd), filepath.Join(parent.Name(), name))
	if !created {
		return d, false, nil
	}
	if err := StripACL(d); err != nil {
		d.Close()
		return nil, false, err
	}
	if err := SetDirAttrs(d, mode, uid, gid); err != nil {
		d.Close()
		return nil, false, err
	}
	if err := parent.Sync(); err != nil {
		d.Close()
		return nil, false, fmt.Errorf("fsync %s: %w", parent.Name(), err)
	}
	return d, true, nil
}

// SyncDir fsyncs the directory dir, making the entries created or removed
// in it durable. dir is reached without following a symlink.
func SyncDir(dir string) error {
	d, err := OpenNoFollow(dir, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}
