package command

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// View is how a check command sees a candidate version: as the content of
// the mount's own directory, in a private mount namespace, so that a
// program whose stock configuration includes the mount's visible paths
// (nginx including /etc/nginx/conf.d/kvmount/*.conf, haproxy, a schema
// checker) tests exactly the new content — not the live one.
type View struct {
	// MountDir is the mount directory's path; Mount identifies the
	// directory kvmount writes there (a tmpfs mount's root).
	MountDir string
	Mount    fsutil.Ident
	// Version is the candidate version directory's name in MountDir, and
	// VersionIdent its identity.
	Version      string
	VersionIdent fsutil.Ident
}

// ErrNoNamespace is returned (wrapped) when no private mount namespace
// can be made: kvmount lacks CAP_SYS_ADMIN, or a seccomp filter or
// systemd's RestrictNamespaces= refuses unshare(CLONE_NEWNS).
var ErrNoNamespace = errors.New("no private mount namespace can be made")

var (
	probeOnce sync.Once
	probeErr  error
)

// NamespaceViews returns nil when check commands can run in a private
// mount namespace (RunInView), or an error wrapping ErrNoNamespace that
// says why not. It probes once, on a thread of its own that ends with it.
func NamespaceViews() error {
	probeOnce.Do(func() {
		fsutil.OnThrowawayThread(func() { probeErr = privateNamespace() })
	})
	return probeErr
}

// privateNamespace moves the calling thread into a new mount namespace in
// which no mount or unmount propagates to the host's.
func privateNamespace() error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("%w: unshare: %w", ErrNoNamespace, err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("%w: making / private: %w", ErrNoNamespace, err)
	}
	return nil
}

// RunInView runs s as Run does (in "/" unless s.Dir says otherwise), in a
// private mount namespace in which the candidate version v names is
// bind-mounted read-only (nosuid, nodev) over v.MountDir. The candidate and the
// mount directory are found again by path inside the namespace, without
// following a symlink, and must have the identities v records: a path
// that now reaches another directory fails the check (fsutil.ErrReplaced),
// so the command sees exactly the version kvmount built.
//
// When someone other than root can replace a component of v.MountDir's
// path (fsutil.Exposures), a rename there after the bind could still
// redirect the command's lookups: the topmost such directory is covered,
// in the namespace only, by an empty tmpfs holding just the path down to
// the candidate. The check then sees nothing else below that directory.
//
// The namespace lives on a thread of its own, locked to this call and
// ended with it (never the main thread), and in the command's processes:
// nothing is mounted in the host's namespace, and nothing is left when the
// check ends, however it ends. Errors are Run's, one wrapping ErrNoNamespace when no namespace
// can be made (see NamespaceViews), and those of preparing the view.
func RunInView(ctx context.Context, s Spec, v View) (string, error) {
	var out string
	var err error
	fsutil.OnThrowawayThread(func() {
		if err = privateNamespace(); err != nil {
			return
		}
		if err = v.mount(); err != nil {
			err = fmt.Errorf("preparing the check's view of %s: %w", v.MountDir, err)
			return
		}
		out, err = Run(ctx, s)
	})
	return out, err
}

// mount shows the candidate at v.MountDir in the calling thread's private
// mount namespace.
func (v View) mount() error {
	d, err := fsutil.OpenDir(v.MountDir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := fsutil.CheckIdent(d, v.MountDir, &v.Mount); err != nil {
		return err
	}
	fd, err := unix.Openat(int(d.Fd()), v.Version, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &fs.PathError{Op: "open", Path: filepath.Join(v.MountDir, v.Version), Err: err}
	}
	candidate := os.NewFile(uintptr(fd), filepath.Join(v.MountDir, v.Version))
	defer candidate.Close()
	if err := fsutil.CheckIdent(candidate, candidate.Name(), &v.VersionIdent); err != nil {
		return err
	}
	target := d
	exposed, err := fsutil.Exposures(v.MountDir)
	if err != nil {
		return err
	}
	if len(exposed) > 0 {
		if target, err = cover(exposed[0].Dir, v.MountDir); err != nil {
			return err
		}
		defer target.Close()
	}
	tree, err := unix.OpenTree(int(candidate.Fd()), "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_EMPTY_PATH)
	if err != nil {
		return &fs.PathError{Op: "open_tree", Path: candidate.Name(), Err: err}
	}
	defer unix.Close(tree)
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV}
	setattr := unix.MountSetattr(tree, "", unix.AT_EMPTY_PATH, &attr)
	if setattr != nil && !errors.Is(setattr, unix.ENOSYS) {
		return &fs.PathError{Op: "mount_setattr", Path: candidate.Name(), Err: setattr}
	}
	if err := unix.MoveMount(tree, "", int(target.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return &fs.PathError{Op: "bind", Path: v.MountDir, Err: err}
	}
	if setattr != nil {
		// Before Linux 5.12 (no mount_setattr): remount the bind, whose
		// root tree still holds, read-only.
		treePath := fmt.Sprintf("/proc/self/fd/%d", tree)
		if err := unix.Mount("", treePath, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
			return &fs.PathError{Op: "remount read-only", Path: v.MountDir, Err: err}
		}
	}
	return nil
}

// cover mounts an empty tmpfs over the directory top, an ancestor of dir,
// creates dir's path below top in it, and returns that directory open.
func cover(top, dir string) (*os.File, error) {
	rel, err := filepath.Rel(top, dir)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return nil, fmt.Errorf("%s does not lie below %s", dir, top)
	}
	t, err := fsutil.OpenDir(top)
	if err != nil {
		return nil, err
	}
	defer t.Close()
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return nil, &fs.PathError{Op: "fsopen tmpfs", Path: top, Err: err}
	}
	defer unix.Close(fsfd)
	for _, kv := range [][2]string{{"source", "kvmount-check"}, {"size", "64k"}, {"nr_inodes", "64"}, {"mode", "0755"}} {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return nil, &fs.PathError{Op: "tmpfs option " + kv[0], Path: top, Err: err}
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return nil, &fs.PathError{Op: "create tmpfs", Path: top, Err: err}
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return nil, &fs.PathError{Op: "fsmount", Path: top, Err: err}
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", int(t.Fd()), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return nil, &fs.PathError{Op: "cover", Path: top, Err: err}
	}
	fd, err := unix.Openat(mfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: top, Err: err}
	}
	cur := os.NewFile(uintptr(fd), top)
	for _, elem := range strings.Split(rel, string(filepath.Separator)) {
		next, _, err := fsutil.MakeDirAt(cur, elem, 0o755, 0, 0)
		cur.Close()
		if err != nil {
			return nil, err
		}
		cur = next
	}
	return cur, nil
}
