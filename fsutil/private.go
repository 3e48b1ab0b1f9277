package fsutil

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNotPrivate is returned (wrapped) by OpenPrivateDir for a directory
// that someone other than root can write, or replace: kvmount keeps its
// record of what it owns there, and a record others can forge would make
// it take over, and empty, a directory of theirs.
var ErrNotPrivate = errors.New("not a directory only root can write")

// OpenPrivateDir opens the directory path — kvmount's state directory —
// and returns it open, after making sure that no one but root (this
// process's user) can change what it holds or what the path reaches: no
// directory on the path lets another user replace the next component
// (Exposures), the directory is root's, and neither its group, nor others,
// nor its ACL lets anyone else write it. A missing directory is created,
// mode 0700 (missing parents 0755, root's); an existing one that others
// can read is tightened to 0700 through its handle. The path is resolved
// without following a symlink in any component (a symlink is ErrSymlink,
// never followed, and what it points at is never touched). Otherwise it
// returns an error wrapping ErrNotPrivate that names the directory and who
// can write it.
func OpenPrivateDir(path string) (*os.File, error) {
	path = filepath.Clean(path)
	if err := CheckPrivateDir(path); err != nil {
		return nil, err
	}
	d, _, err := MakeDir(path, 0o700, -1, -1)
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(d.Fd()), &st); err != nil {
		d.Close()
		return nil, fmt.Errorf("fstat %s: %w", path, err)
	}
	if err := privateOwner(path, &st); err != nil {
		d.Close()
		return nil, err
	}
	if st.Mode&0o077 != 0 {
		if err := d.Chmod(0o700); err != nil {
			d.Close()
			return nil, err
		}
	}
	return d, nil
}

// CheckPrivateDir returns what OpenPrivateDir would refuse of path,
// without creating or changing anything: an error wrapping ErrNotPrivate
// (or ErrSymlink) when a directory on the path lets someone other than
// root replace the next component, or when path exists and is not root's
// alone. A path that does not exist yet, below directories only root can
// write, is nil.
func CheckPrivateDir(path string) error {
	path = filepath.Clean(path)
	exposed, err := Exposures(path)
	if err != nil {
		return err
	}
	if len(exposed) > 0 {
		return fmt.Errorf("%s: %w: %v; give the directory and its parents to root (chown root:root, chmod go-w) or choose another state_dir", path, ErrNotPrivate, exposed[0])
	}
	d, err := OpenNoFollow(path, unix.O_RDONLY|unix.O_DIRECTORY)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer d.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(d.Fd()), &st); err != nil {
		return fmt.Errorf("fstat %s: %w", path, err)
	}
	return privateOwner(path, &st)
}

// privateOwner returns an error wrapping ErrNotPrivate unless the directory
// path, whose stat is st, is this process's user's and no one else can
// write it (mode or ACL).
func privateOwner(path string, st *unix.Stat_t) error {
	if int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("%s: %w: it is owned by %s; chown it to root, or choose another state_dir", path, ErrNotPrivate, userName(st.Uid))
	}
	w := inspectDir(path)
	switch {
	case w.err != nil:
		return w.err
	case w.who != "":
		return fmt.Errorf("%s: %w: it is writable by %s; chmod 0700 it, or choose another state_dir", path, ErrNotPrivate, strings.TrimSpace(w.who))
	}
	return nil
}
