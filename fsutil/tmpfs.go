package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// TmpfsSource is the mount source ("device") of every tmpfs kvmount mounts,
// shown in /proc/self/mountinfo, findmnt and df. It is how kvmount tells its
// own tmpfs from one somebody else mounted: kvmount remounts and unmounts
// only a tmpfs whose source it is.
const TmpfsSource = "kvmount"

// ErrForeignMount is returned for a mount directory on which a file system
// that kvmount did not mount is mounted: a tmpfs of another source, or any
// other file system type. kvmount never remounts or unmounts it.
var ErrForeignMount = errors.New("a file system kvmount did not mount is mounted there")

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

func (o TmpfsOptions) data(noswap bool) string {
	data := fmt.Sprintf("size=%d,mode=%04o", o.Size, o.Mode.Perm())
	if o.UID >= 0 {
		data += fmt.Sprintf(",uid=%d", o.UID)
	}
	if o.GID >= 0 {
		data += fmt.Sprintf(",gid=%d", o.GID)
	}
	if noswap {
		data += ",noswap"
	}
	return data
}

// MountState is what is mounted at a mount directory.
type MountState int

// Mount states.
const (
	// NotMounted: the directory is no mount point.
	NotMounted MountState = iota
	// OwnTmpfs: a tmpfs kvmount mounted (source TmpfsSource).
	OwnTmpfs
	// ForeignMount: any other file system mounted there.
	ForeignMount
)

// mountAt returns what is mounted at the open directory d, and its
// mountinfo entry when something is. A directory is a mount point when its
// mount ID (statx STATX_MNT_ID) differs from its parent's; statfs alone is
// not enough, as any directory under /run is on a tmpfs without being a
// mount point (kubelet, emptyDir medium Memory).
func mountAt(d *os.File) (MountState, *mountinfo.Info, error) {
	var st, parent unix.Statx_t
	if err := unix.Statx(int(d.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &st); err != nil {
		return 0, nil, &fs.PathError{Op: "statx", Path: d.Name(), Err: err}
	}
	if err := unix.Statx(int(d.Fd()), "..", 0, unix.STATX_MNT_ID, &parent); err != nil {
		return 0, nil, &fs.PathError{Op: "statx", Path: d.Name() + "/..", Err: err}
	}
	if st.Mask&unix.STATX_MNT_ID == 0 {
		return 0, nil, fmt.Errorf("%s: the kernel reports no mount IDs (Linux 5.8 or later is needed)", d.Name())
	}
	if st.Mnt_id == parent.Mnt_id {
		return NotMounted, nil, nil
	}
	id := int(st.Mnt_id)
	infos, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) {
		return i.ID != id, i.ID == id
	})
	if err != nil {
		return 0, nil, fmt.Errorf("%s: %w", d.Name(), err)
	}
	if len(infos) == 0 {
		return 0, nil, fmt.Errorf("%s: mount %d is not in /proc/self/mountinfo", d.Name(), id)
	}
	info := infos[0]
	if info.FSType == "tmpfs" && info.Source == TmpfsSource {
		return OwnTmpfs, info, nil
	}
	return ForeignMount, info, nil
}

// MountStateOf reports what is mounted at dir, which must be a real
// directory (see OpenDir).
func MountStateOf(dir string) (MountState, error) {
	d, err := OpenDir(dir)
	if err != nil {
		return 0, err
	}
	defer d.Close()
	state, _, err := mountAt(d)
	return state, err
}

// MountTmpfs mounts a tmpfs of source TmpfsSource at dir with the options,
// nosuid, nodev, noexec and, where the kernel supports it (Linux ≥ 6.4),
// noswap, so that its content never reaches swap; an older kernel mounts
// without noswap. If dir already holds kvmount's tmpfs it is remounted with
// the options instead — its content stays, mounts are never stacked — and
// the root directory is given the mode and owner with fchmod/fchown, which
// a remount does not change. Another file system mounted at dir is refused
// with ErrForeignMount before any mount call. dir is reached without
// following a symlink (OpenDir).
func MountTmpfs(dir string, o TmpfsOptions) error {
	d, err := OpenDir(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	state, info, err := mountAt(d)
	if err != nil {
		return err
	}
	switch state {
	case ForeignMount:
		return fmt.Errorf("%s: %w (%s of source %q); kvmount leaves it alone", dir, ErrForeignMount, info.FSType, info.Source)
	case OwnTmpfs:
		// noswap cannot change on a remount: keep what the mount has.
		noswap := hasOption(info.VFSOptions, "noswap")
		target := ProcPath(d)
		if err := unix.Mount(TmpfsSource, target, "tmpfs", tmpfsFlags|unix.MS_REMOUNT, o.data(noswap)); err != nil {
			return &fs.PathError{Op: "remount tmpfs", Path: dir, Err: err}
		}
		root, err := OpenDir(dir)
		if err != nil {
			return err
		}
		defer root.Close()
		return SetDirAttrs(root, o.Mode, o.UID, o.GID)
	}
	target := ProcPath(d)
	err = unix.Mount(TmpfsSource, target, "tmpfs", tmpfsFlags, o.data(true))
	if errors.Is(err, unix.EINVAL) {
		// A kernel before 6.4 does not know noswap.
		err = unix.Mount(TmpfsSource, target, "tmpfs", tmpfsFlags, o.data(false))
	}
	if err != nil {
		return &fs.PathError{Op: "mount tmpfs", Path: dir, Err: err}
	}
	return nil
}

// hasOption reports whether the comma-separated options hold opt.
func hasOption(options, opt string) bool {
	for o := range strings.SplitSeq(options, ",") {
		if o == opt {
			return true
		}
	}
	return false
}

// UnmountTmpfs unmounts kvmount's tmpfs at dir, if dir holds one, with
// UMOUNT_NOFOLLOW. When the mount is busy (a process has a file open on it)
// it is detached instead (MNT_DETACH): it disappears from dir now and is
// freed when the last user closes it. A missing dir is no error; a symlink
// at dir is refused (ErrNotDir), and another file system mounted at dir
// (ErrForeignMount) is left mounted.
func UnmountTmpfs(dir string) error {
	d, err := OpenDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	state, info, err := mountAt(d)
	d.Close()
	switch {
	case err != nil:
		return err
	case state == NotMounted:
		return nil
	case state == ForeignMount:
		return fmt.Errorf("%s: %w (%s of source %q); kvmount leaves it mounted", dir, ErrForeignMount, info.FSType, info.Source)
	}
	err = unix.Unmount(dir, unix.UMOUNT_NOFOLLOW)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(dir, unix.UMOUNT_NOFOLLOW|unix.MNT_DETACH)
	}
	if err != nil {
		return &fs.PathError{Op: "unmount", Path: dir, Err: err}
	}
	return nil
}
