package projector

import (
	"bytes"
	"io/fs"
	"path"
	"slices"
	"strings"
)

// File is one file of a payload: its bytes, permission bits and owner.
type File struct {
	// Data is the file content. It is never modified once in a payload.
	Data []byte
	// Mode holds the permission bits (0o777); other bits are ignored.
	Mode fs.FileMode
	// UID and GID own the file, as numeric ids.
	UID, GID int
}

// Equal reports whether f and g have the same data, permission bits and owner.
func (f File) Equal(g File) bool {
	return f.Mode.Perm() == g.Mode.Perm() && f.UID == g.UID && f.GID == g.GID && bytes.Equal(f.Data, g.Data)
}

// Payload is the full content of a mount: cleaned relative path → file (the
// kubelet's map[string]FileProjection). Paths use "/" and pass CleanPath.
type Payload map[string]File

// Equal reports whether p and q hold the same paths with equal files.
func (p Payload) Equal(q Payload) bool {
	if len(p) != len(q) {
		return false
	}
	for name, f := range p {
		g, ok := q[name]
		if !ok || !f.Equal(g) {
			return false
		}
	}
	return true
}

// Size returns the total number of data bytes in p.
func (p Payload) Size() int64 {
	var n int64
	for _, f := range p {
		n += int64(len(f.Data))
	}
	return n
}

// Paths returns the paths of p, sorted.
func (p Payload) Paths() []string {
	names := make([]string, 0, len(p))
	for name := range p {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// Change tells what a write changed, as sorted payload paths.
type Change struct {
	// Added are files new in the payload.
	Added []string
	// Changed are files whose data, mode or owner changed.
	Changed []string
	// Removed are files gone from the payload.
	Removed []string
	// RemovedDirs are directories no file of the payload needs any more
	// (with Removed, the kubelet's pathsToRemove), parents before children.
	RemovedDirs []string
}

// Empty reports whether c changes nothing.
func (c Change) Empty() bool {
	return len(c.Added) == 0 && len(c.Changed) == 0 && len(c.Removed) == 0
}

// Diff returns what turns old into new. A nil old is an empty payload.
func Diff(old, new Payload) Change {
	var c Change
	for name, f := range new {
		g, ok := old[name]
		switch {
		case !ok:
			c.Added = append(c.Added, name)
		case !f.Equal(g):
			c.Changed = append(c.Changed, name)
		}
	}
	kept := directories(new)
	for dir := range directories(old) {
		if !kept[dir] {
			c.RemovedDirs = append(c.RemovedDirs, dir)
		}
	}
	for name := range old {
		if _, ok := new[name]; !ok {
			c.Removed = append(c.Removed, name)
		}
	}
	slices.Sort(c.Added)
	slices.Sort(c.Changed)
	slices.Sort(c.Removed)
	slices.Sort(c.RemovedDirs)
	return c
}

// directories returns every directory that p's paths need, such as "a" and
// "a/b" for "a/b/c".
func directories(p Payload) map[string]bool {
	dirs := map[string]bool{}
	for name := range p {
		for dir := path.Dir(name); dir != "." && !dirs[dir]; dir = path.Dir(dir) {
			dirs[dir] = true
		}
	}
	return dirs
}

// topLevel returns the first path elements of p: the user-visible entries of
// a mount.
func topLevel(p Payload) map[string]bool {
	names := map[string]bool{}
	for name := range p {
		first, _, _ := strings.Cut(name, "/")
		names[first] = true
	}
	return names
}
