package fsutil

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// A directory kvmount owns carries a marker: an extended attribute in the
// trusted namespace, whose value is a random token kvmount records beside
// the directory's identity. Only a process with CAP_SYS_ADMIN can set,
// change, remove or even read an attribute in that namespace (xattr(7);
// the kernel checks it in the VFS, for every file system), so a user who
// can write one of the directory's parents can rename it away and put
// another in its place, but cannot give that one the marker — nor learn
// it from the real one, nor strip it. Unlike st_dev, which the kernel
// hands out in mount order (FUSE, btrfs, tmpfs and other anonymous-device
// file systems get another one after a remount or reboot), the marker
// stays with the directory's inode: it survives reboots, remounts and
// renumbering wherever the file system keeps extended attributes.

// MarkerAttr is the name of the marker attribute.
const MarkerAttr = "trusted.kvmount.mount"

// markerLen is the length of a marker token, in bytes of hexadecimal text
// (128 random bits).
const markerLen = 32

// ErrNoMarker is returned (wrapped) by ReadMarker and SetMarker when the
// directory's file system keeps no extended attribute in the trusted
// namespace (sshfs, NFS, 9p without xattr support, a FUSE file system that
// does not implement them), or kvmount lacks CAP_SYS_ADMIN to use one.
var ErrNoMarker = errors.New("the file system keeps no trusted extended attribute")

// ErrUnrecognized is returned (wrapped) for a mount directory that kvmount
// cannot recognise either way: its file system keeps no marker, and its
// file-system identity changed since kvmount recorded it. A remount or
// reboot that renumbered the file system does that; so does a user who
// can write a parent and swapped the directory. kvmount refuses it until
// an operator says it is the mount's (kvmount adopt).
var ErrUnrecognized = errors.New("kvmount cannot tell whether the path still reaches the directory it owns")

// NewMarker returns a fresh marker token: 128 random bits in hexadecimal.
func NewMarker() (string, error) {
	var b [markerLen / 2]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("marker: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// ReadMarker returns the marker of the open directory d, "" when it has
// none. It returns an error wrapping ErrNoMarker when d's file system
// keeps no trusted attribute; a value that is not a marker token (another
// length, not hexadecimal) is returned as it is, so that it never matches
// a recorded one.
func ReadMarker(d *os.File) (string, error) {
	buf := make([]byte, markerLen+1)
	n, err := unix.Fgetxattr(int(d.Fd()), MarkerAttr, buf)
	switch {
	case err == nil:
		return string(buf[:n]), nil
	case errors.Is(err, unix.ENODATA):
		return "", nil
	case errors.Is(err, unix.ERANGE):
		return "(a longer value)", nil
	case noMarker(err):
		return "", fmt.Errorf("%s: %w: %w", d.Name(), ErrNoMarker, err)
	}
	return "", &fs.PathError{Op: "getxattr " + MarkerAttr, Path: d.Name(), Err: err}
}

// SetMarker gives the open directory d the marker token and fsyncs it, so
// that the attribute survives a crash. It returns an error wrapping
// ErrNoMarker when d's file system keeps no trusted attribute.
func SetMarker(d *os.File, token string) error {
	err := unix.Fsetxattr(int(d.Fd()), MarkerAttr, []byte(token), 0)
	if noMarker(err) {
		return fmt.Errorf("%s: %w: %w", d.Name(), ErrNoMarker, err)
	}
	if err != nil {
		return &fs.PathError{Op: "setxattr " + MarkerAttr, Path: d.Name(), Err: err}
	}
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", d.Name(), err)
	}
	return nil
}

// noMarker reports whether err says the file system (or kvmount's
// privilege) allows no trusted attribute: ENOTSUP/EOPNOTSUPP (no xattr
// support), ENOSYS (a FUSE server without the operation), EPERM (no
// CAP_SYS_ADMIN).
func noMarker(err error) bool {
	return errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EPERM)
}

// Owned is what kvmount recorded of a directory it owns, to recognise it
// later: its identity when last seen, and the marker it set on it ("" when
// its file system keeps none). Both zero: nothing recorded yet.
type Owned struct {
	Ident  *Ident
	Marker string
}

// RecognizeOrReadopt is Recognize, except where Recognize can tell
// nothing (rule 5: no marker, and the file system renumbered by a remount
// or reboot, as FUSE's and 9p's are, which keep no f_fsid either): when d
// is root's and no one but root can replace it at path — no directory on
// path is exposed (Exposures) — nobody but root could have put it there,
// and it is taken as kvmount's own: readopted is true, so that the caller
// says so in its log. Where someone else could have, it is refused as
// Recognize refuses it.
func RecognizeOrReadopt(d *os.File, path string, o Owned) (readopted bool, err error) {
	err = Recognize(d, path, o)
	if !errors.Is(err, ErrUnrecognized) {
		return false, err
	}
	var st unix.Stat_t
	if unix.Fstat(int(d.Fd()), &st) != nil || st.Uid != 0 {
		return false, err
	}
	if exposed, xerr := Exposures(path); xerr != nil || len(exposed) > 0 {
		return false, err
	}
	return true, nil
}

// Recognize returns nil when the open directory d, reached at path, is the
// directory o records, or when o records nothing. The rules, in order:
//
//  1. d carries the recorded marker: it is the directory, whatever its
//     st_dev or inode number now (a remount or reboot renumbers them).
//  2. d has the recorded identity (file system and inode): it is the
//     directory (its marker may be missing or another because it was
//     never recorded: a record from an older kvmount, a crash between
//     setting the marker and recording it, a file system that keeps
//     none). A user can place at the path only directories of the
//     parent's file system, none of which has that inode number but the
//     directory itself.
//  3. d carries another marker: it is another directory kvmount owns (for
//     another mount, or another kvmount) — ErrReplaced.
//  4. A marker was recorded and d has none: it is another directory —
//     ErrReplaced.
//  5. Nothing recorded tells: no marker, and d's file system is another
//     one than recorded (or renumbered) — ErrUnrecognized, wrapping
//     ErrReplaced too.
//  6. Otherwise (same file system, another inode) — ErrReplaced.
//
// The errors name path and both identities.
func Recognize(d *os.File, path string, o Owned) error {
	if o.Ident == nil && o.Marker == "" {
		return nil
	}
	marker, merr := ReadMarker(d)
	if merr != nil && !errors.Is(merr, ErrNoMarker) {
		return merr
	}
	if o.Marker != "" && marker == o.Marker {
		return nil
	}
	got, err := IdentOf(d)
	if err != nil {
		return err
	}
	switch {
	case o.Ident != nil && got == *o.Ident:
		return nil
	case marker != "":
		return fmt.Errorf("%s: %w (it carries another kvmount marker: another mount's directory)", path, ErrReplaced)
	case o.Marker != "":
		return fmt.Errorf("%s: %w (it lacks the marker kvmount set on its own, %s)", path, ErrReplaced, MarkerAttr)
	case o.Ident != nil && got.FS != o.Ident.FS:
		return fmt.Errorf("%s: %w: %w (its file system keeps no marker, and it is on another file system, or the same one renumbered by a remount or reboot: found %v, kvmount owns %v)", path, ErrReplaced, ErrUnrecognized, got, *o.Ident)
	}
	want := Ident{}
	if o.Ident != nil {
		want = *o.Ident
	}
	return fmt.Errorf("%s: %w (found %v, kvmount owns %v)", path, ErrReplaced, got, want)
}
