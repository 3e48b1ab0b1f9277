package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
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
	// Inodes is the most files, directories and symlinks the tmpfs holds
	// (nr_inodes); 0 leaves tmpfs's default (half the RAM's pages).
	Inodes int64
	// Mode is the permission of the tmpfs's root directory.
	Mode fs.FileMode
	// UID and GID own the root directory; -1 means 0 (root), tmpfs's
	// default.
	UID, GID int
}

// settings returns the options as tmpfs's mount options (tmpfs(5)), in
// order; noswap is added by the caller where the kernel has it.
func (o TmpfsOptions) settings() [][2]string {
	s := [][2]string{{"size", strconv.FormatInt(o.Size, 10)}, {"mode", fmt.Sprintf("%04o", o.Mode.Perm())}}
	if o.Inodes > 0 {
		s = append(s, [2]string{"nr_inodes", strconv.FormatInt(o.Inodes, 10)})
	}
	if o.UID >= 0 {
		s = append(s, [2]string{"uid", strconv.Itoa(o.UID)})
	}
	if o.GID >= 0 {
		s = append(s, [2]string{"gid", strconv.Itoa(o.GID)})
	}
	return s
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

// MountAt returns what is mounted at the open directory d, and its
// mountinfo entry when something is. A directory is a mount point when its
// mount ID (statx STATX_MNT_ID, Linux 5.8) differs from its parent's;
// statfs alone is not enough, as any directory under /run is on a tmpfs
// without being a mount point (kubelet, emptyDir medium Memory). d is the
// root of what is mounted when something is.
func MountAt(d *os.File) (MountState, *mountinfo.Info, error) {
	var st, parent unix.Statx_t
	if err := unix.Statx(int(d.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_MNT_ID, &st); err != nil {
		return 0, nil, &fs.PathError{Op: "statx", Path: d.Name(), Err: err}
	}
	if err := unix.Statx(int(d.Fd()), "..", unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &parent); err != nil {
		return 0, nil, &fs.PathError{Op: "statx", Path: d.Name() + "/..", Err: err}
	}
	if st.Mask&unix.STATX_MNT_ID == 0 {
		return 0, nil, fmt.Errorf("%s: the kernel reports no mount IDs (Linux 5.8 or later is needed)", d.Name())
	}
	if st.Mnt_id == parent.Mnt_id {
		return NotMounted, nil, nil
	}
	id := int(st.Mnt_id)
	// The calling thread's mount table: /proc/self/mountinfo is the
	// main thread's, which need not be in the same mount namespace.
	f, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return 0, nil, fmt.Errorf("%s: %w", d.Name(), err)
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, func(i *mountinfo.Info) (skip, stop bool) {
		return i.ID != id, i.ID == id
	})
	if err != nil {
		return 0, nil, fmt.Errorf("%s: %w", d.Name(), err)
	}
	if len(infos) == 0 {
		return 0, nil, fmt.Errorf("%s: mount %d is not in /proc/thread-self/mountinfo", d.Name(), id)
	}
	info := infos[0]
	if info.FSType == "tmpfs" && info.Source == TmpfsSource {
		return OwnTmpfs, info, nil
	}
	return ForeignMount, info, nil
}

// MountStateOf reports what is mounted at dir, which must be a real
// directory reached without a symlink (see OpenDir).
func MountStateOf(dir string) (MountState, error) {
	d, err := OpenDir(dir)
	if err != nil {
		return 0, err
	}
	defer d.Close()
	state, _, err := MountAt(d)
	return state, err
}

// MountTmpfs mounts a new tmpfs of source TmpfsSource with the options on
// the open directory d, which must not be a mount point already, and
// returns the new tmpfs's root directory open. The mount is made with the
// mount API (fsopen, fsmount, move_mount; Linux 5.2) onto d itself, so no
// path is looked up again between the check of d and the mount, and the
// root comes back as a handle. It is nosuid, nodev, noexec and, where the
// kernel supports it (Linux ≥ 6.4), noswap, so that its content never
// reaches swap. A mount point at d is refused before anything is mounted:
// kvmount's own tmpfs (use RemountTmpfs) or ErrForeignMount.
func MountTmpfs(d *os.File, o TmpfsOptions) (*os.File, error) {
	state, info, err := MountAt(d)
	if err != nil {
		return nil, err
	}
	switch state {
	case OwnTmpfs:
		return nil, fmt.Errorf("%s: kvmount's tmpfs is mounted there already", d.Name())
	case ForeignMount:
		return nil, fmt.Errorf("%s: %w (%s of source %q); kvmount leaves it alone", d.Name(), ErrForeignMount, info.FSType, info.Source)
	}
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return nil, &fs.PathError{Op: "fsopen tmpfs", Path: d.Name(), Err: err}
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", TmpfsSource); err != nil {
		return nil, &fs.PathError{Op: "tmpfs option source", Path: d.Name(), Err: err}
	}
	for _, kv := range o.settings() {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return nil, &fs.PathError{Op: "tmpfs option " + kv[0] + "=" + kv[1], Path: d.Name(), Err: err}
		}
	}
	// A kernel before 6.4 does not know noswap.
	_ = unix.FsconfigSetFlag(fsfd, "noswap")
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return nil, &fs.PathError{Op: "create tmpfs", Path: d.Name(), Err: err}
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return nil, &fs.PathError{Op: "fsmount tmpfs", Path: d.Name(), Err: err}
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", int(d.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return nil, &fs.PathError{Op: "mount tmpfs", Path: d.Name(), Err: err}
	}
	fd, err := unix.Openat(mfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open tmpfs root", Path: d.Name(), Err: err}
	}
	return os.NewFile(uintptr(fd), d.Name()), nil
}

// RemountTmpfs applies the options to kvmount's tmpfs whose root directory
// is open as root — its content stays, mounts are never stacked — and gives
// the root the mode and owner with fchmod/fchown, which a remount does not
// change. noswap stays as it was mounted. Another file system is refused
// with ErrForeignMount.
func RemountTmpfs(root *os.File, o TmpfsOptions) error {
	state, info, err := MountAt(root)
	if err != nil {
		return err
	}
	if state != OwnTmpfs {
		what := "no mount point"
		if info != nil {
			what = fmt.Sprintf("%s of source %q", info.FSType, info.Source)
		}
		return fmt.Errorf("%s: %w (%s); kvmount leaves it alone", root.Name(), ErrForeignMount, what)
	}
	var data []string
	for _, kv := range o.settings() {
		data = append(data, kv[0]+"="+kv[1])
	}
	if hasOption(info.VFSOptions, "noswap") {
		data = append(data, "noswap")
	}
	// The magic link names exactly the mount whose root root holds.
	if err := unix.Mount(TmpfsSource, ProcPath(root), "tmpfs", tmpfsFlags|unix.MS_REMOUNT, strings.Join(data, ",")); err != nil {
		return &fs.PathError{Op: "remount tmpfs", Path: root.Name(), Err: err}
	}
	return SetDirAttrs(root, o.Mode, o.UID, o.GID)
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

// UnmountTmpfs detaches kvmount's tmpfs whose root directory is open as
// root (umount2 with MNT_DETACH on the handle's /proc/self/fd path, so
// that no path is looked up again): it disappears from the mount
// directory at once and is freed when its last user — root itself among
// them — closes it. Another file system is left mounted (ErrForeignMount);
// a directory that is no mount point is no error.
func UnmountTmpfs(root *os.File) error {
	state, info, err := MountAt(root)
	switch {
	case err != nil:
		return err
	case state == NotMounted:
		return nil
	case state == ForeignMount:
		return fmt.Errorf("%s: %w (%s of source %q); kvmount leaves it mounted", root.Name(), ErrForeignMount, info.FSType, info.Source)
	}
	if err := unix.Unmount(ProcPath(root), unix.MNT_DETACH); err != nil {
		return &fs.PathError{Op: "unmount", Path: root.Name(), Err: err}
	}
	return nil
}
