package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/untrusted"
)

// Exposure is a directory on a path in which a user other than root can
// rename, replace or create the next component of that path — and so make
// the path reach a directory of their choosing. sshd's StrictModes refuses
// such paths for authorized_keys; kvmount warns about them (kvmount check)
// and protects what it can: it resolves every path without symlinks,
// refuses a mount directory whose identity changed, and shows a check
// command its candidate through a private mount namespace that the
// exposed directory's renames cannot reach.
type Exposure struct {
	// Dir is the exposed directory.
	Dir string
	// Next is the component of the path inside Dir that can be replaced.
	Next string
	// Reason says who can write Dir and how.
	Reason string
}

// String describes the exposure for a warning.
func (e Exposure) String() string {
	return fmt.Sprintf("%s %s, so someone other than root can replace %s", e.Dir, e.Reason, filepath.Join(e.Dir, e.Next))
}

// Exposures returns the directories on the absolute path — / and every
// ancestor of path's last component — in which someone other than root can
// replace the next component, topmost first. A directory is exposed when a
// non-root user owns it; or when its group (other than root's) or every
// user may write it, or its access ACL names a non-root user or group that
// may, unless it is sticky (chmod +t, as /tmp) and the next component
// exists and belongs to root. The walk ends at the first component that
// does not exist. A symlink component is an error wrapping ErrSymlink.
// To audit many paths that share ancestors, use an Auditor.
func Exposures(path string) ([]Exposure, error) {
	return new(Auditor).Exposures(path)
}

// An Auditor finds the Exposures of many paths, inspecting each directory
// they share once: the 1,000 mount directories of one parent cost one
// open, fstat and ACL read of each ancestor in all, and one lstat each.
// It keeps what it saw of each directory, so a directory changed after its
// first inspection is not seen again: use an Auditor for one audit only.
// The zero value is ready to use; it is not safe for concurrent use.
type Auditor struct {
	dirs map[string]writers
}

// writers is what an Auditor saw of a directory: who other than root can
// write it ("" for nobody), whether it is sticky, or why it could not be
// inspected.
type writers struct {
	owner  string // the non-root owner, "" when root owns it
	who    string
	sticky bool
	err    error
}

// Exposures is Exposures, with each directory inspected once per Auditor.
func (a *Auditor) Exposures(path string) ([]Exposure, error) {
	path = filepath.Clean(path)
	if !filepath.IsAbs(path) {
		return nil, fmt.Errorf("%s: not an absolute path", path)
	}
	var out []Exposure
	dir := "/"
	for _, elem := range strings.Split(strings.TrimPrefix(path, "/"), "/") {
		if elem == "" {
			break
		}
		next := filepath.Join(dir, elem)
		var child unix.Stat_t
		childErr := unix.Lstat(next, &child)
		if childErr == nil && child.Mode&unix.S_IFMT == unix.S_IFLNK {
			target, _ := os.Readlink(next)
			target = untrusted.Escape(target) // chosen by whoever can write the directory
			return out, fmt.Errorf("%s: %w: %s is a symlink (to %s), and kvmount follows no symlink in a path", path, ErrSymlink, next, target)
		}
		exists := childErr == nil
		w := a.inspect(dir)
		if w.err != nil {
			return out, w.err
		}
		if reason := w.exposure(exists, exists && child.Uid == 0); reason != "" {
			out = append(out, Exposure{Dir: dir, Next: elem, Reason: reason})
		}
		if !exists {
			if errors.Is(childErr, unix.ENOENT) {
				break
			}
			return out, &fs.PathError{Op: "lstat", Path: next, Err: childErr}
		}
		dir = next
	}
	return out, nil
}

// inspect returns who can write dir, inspecting it on its first use.
func (a *Auditor) inspect(dir string) writers {
	if w, ok := a.dirs[dir]; ok {
		return w
	}
	w := inspectDir(dir)
	if a.dirs == nil {
		a.dirs = map[string]writers{}
	}
	a.dirs[dir] = w
	return w
}

// inspectDir opens dir without following a symlink and reads who other
// than root can write it: its owner, its mode's group and other bits, and
// its access ACL.
func inspectDir(dir string) writers {
	d, err := OpenNoFollow(dir, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return writers{err: err}
	}
	defer d.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(d.Fd()), &st); err != nil {
		return writers{err: &fs.PathError{Op: "fstat", Path: dir, Err: err}}
	}
	if st.Uid != 0 {
		return writers{owner: userName(st.Uid)}
	}
	w := writers{sticky: st.Mode&unix.S_ISVTX != 0}
	switch {
	case st.Mode&0o002 != 0:
		w.who = fmt.Sprintf("every user (mode %04o)", st.Mode&0o7777)
	case st.Mode&0o020 != 0 && st.Gid != 0:
		w.who = fmt.Sprintf("group %s (mode %04o)", groupName(st.Gid), st.Mode&0o7777)
	default:
		users, groups, err := ACLWriters(d)
		if err != nil {
			return writers{err: err}
		}
		for _, u := range users {
			if u != 0 {
				w.who = userName(u) + " through its ACL"
				break
			}
		}
		for _, g := range groups {
			if g != 0 && w.who == "" {
				w.who = "group " + groupName(g) + " through its ACL"
			}
		}
	}
	return w
}

// exposure says who other than root can replace an entry of the directory
// w describes, or "". The entry's state is whether it exists and whether
// root owns it, which a sticky directory (chmod +t, as /tmp) protects.
func (w writers) exposure(exists, rootOwned bool) string {
	switch {
	case w.owner != "":
		return "is owned by " + w.owner
	case w.sticky && rootOwned, w.who == "":
		return ""
	case w.sticky && !exists:
		return "is writable by " + w.who + "; it is sticky, but the next component does not exist yet and anyone can create it first"
	case w.sticky:
		return "is writable by " + w.who + "; it is sticky, but the next component is not root's"
	}
	return "is writable by " + w.who
}

// userName returns "user NAME (uid N)", or "uid N" without a name.
func userName(uid uint32) string {
	id := strconv.FormatUint(uint64(uid), 10)
	if u, err := user.LookupId(id); err == nil {
		return fmt.Sprintf("user %s (uid %s)", u.Username, id)
	}
	return "uid " + id
}

// groupName returns "NAME (gid N)", or "gid N" without a name.
func groupName(gid uint32) string {
	id := strconv.FormatUint(uint64(gid), 10)
	if g, err := user.LookupGroupId(id); err == nil {
		return fmt.Sprintf("%s (gid %s)", g.Name, id)
	}
	return "gid " + id
}
