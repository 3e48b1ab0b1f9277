package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// ErrReplaced is returned for a mount directory whose path now reaches
// another directory than the one kvmount owns: someone who can write one
// of its parents renamed the real one away and put another in its place.
// kvmount refuses it — it never projects into, chowns or empties whatever
// the path now reaches.
var ErrReplaced = errors.New("the path reaches another directory than the one kvmount owns")

// Ident identifies a directory: the file system it lives on and its inode
// number. The file system is its statfs(2) f_fsid where it has one, which
// unlike st_dev stays the same across a reboot on btrfs and device-mapper
// volumes; st_dev otherwise.
type Ident struct {
	FS  uint64 `json:"fs"`
	Ino uint64 `json:"ino"`
}

// String returns "fs:ino" in hexadecimal and decimal, for errors.
func (i Ident) String() string { return fmt.Sprintf("%x:%d", i.FS, i.Ino) }

// IdentOf returns the identity of the open file f.
func IdentOf(f *os.File) (Ident, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return Ident{}, &fs.PathError{Op: "fstat", Path: f.Name(), Err: err}
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &sfs); err != nil {
		return Ident{}, &fs.PathError{Op: "fstatfs", Path: f.Name(), Err: err}
	}
	id := Ident{FS: uint64(uint32(sfs.Fsid.Val[0])) | uint64(uint32(sfs.Fsid.Val[1]))<<32, Ino: st.Ino}
	if id.FS == 0 {
		id.FS = st.Dev
	}
	return id, nil
}

// CheckIdent returns nil when the open directory d has the identity want,
// or when want is nil (nothing recorded yet). Otherwise it returns an error
// wrapping ErrReplaced that names path and both identities.
func CheckIdent(d *os.File, path string, want *Ident) error {
	if want == nil {
		return nil
	}
	got, err := IdentOf(d)
	if err != nil {
		return err
	}
	if got != *want {
		return fmt.Errorf("%s: %w (found %v, kvmount owns %v); kvmount leaves it alone — if you replaced it on purpose, remove it and kvmount creates it anew", path, ErrReplaced, got, *want)
	}
	return nil
}
