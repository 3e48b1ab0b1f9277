// Package fsutil holds the few file-system operations kvmount performs on
// mount directories outside the atomic writer: creating a mount directory
// with its owner and checking what a path is.
package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
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
