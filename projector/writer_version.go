package projector

import (
	"path"
	"slices"
	"strings"
)

// version is one version directory and what it holds.
type version struct {
	name string
	// payload is the version's content when this run wrote it, read it
	// back or compared it with a payload; nil while it is known only
	// from its manifest.
	payload Payload
	// manifest is the version's manifest when adopted from it (and
	// payload is nil): the files by hash, until a Write learns their
	// bytes.
	manifest *manifest
	// noManifest is set for a version on disk without a usable manifest
	// (written by an older kvmount): the next Write that finds it
	// unchanged adds one.
	noManifest bool
	// forgotten is set while neither payload nor manifest is held
	// (AtomicWriter.ForgetPayload): the manifest on disk says what the
	// version holds, and is read again when needed (recall). count is
	// then its number of files.
	forgotten bool
	count     int
	// digest is the digest of its payload (Payload.Digest) when known
	// from its manifest: made by this writer, or adopted from one.
	digest string
}

// topLevel returns the first path elements of v's files.
func (v *version) topLevel() map[string]bool {
	if v.payload == nil && v.manifest != nil {
		names := map[string]bool{}
		for _, p := range v.paths() {
			first, _, _ := strings.Cut(p, "/")
			names[first] = true
		}
		return names
	}
	return topLevel(v.payload)
}

// files returns how many files v holds.
func (v *version) files() int {
	if v.forgotten {
		return v.count
	}
	if v.payload == nil && v.manifest != nil {
		return len(v.manifest.Files)
	}
	return len(v.payload)
}

// paths returns v's file paths, sorted.
func (v *version) paths() []string {
	if v.payload == nil && v.manifest != nil {
		return v.manifest.paths()
	}
	return v.payload.Paths()
}

// dirs returns the directories v's files need.
func (v *version) dirs() map[string]bool {
	dirs := map[string]bool{}
	for _, name := range v.paths() {
		for dir := path.Dir(name); dir != "." && !dirs[dir]; dir = path.Dir(dir) {
			dirs[dir] = true
		}
	}
	return dirs
}

// has reports whether v holds the file f at path p: the same bytes, mode
// and owner (by hash, when v is known from its manifest).
func (v *version) has(p string, f File) bool {
	if v.payload == nil && v.manifest != nil {
		i, ok := v.manifest.index[p]
		return ok && v.manifest.Files[i].sameFile(f)
	}
	old, ok := v.payload[p]
	return ok && old.Equal(f)
}

// holds reports whether v holds exactly payload.
func (v *version) holds(payload Payload) bool {
	if v.payload == nil && v.manifest != nil {
		return v.manifest.matchesPayload(payload)
	}
	return v.payload.Equal(payload)
}

// diff returns what turns v into payload.
func (v *version) diff(payload Payload) Change {
	var c Change
	for name, f := range payload {
		if !v.has(name, f) {
			if v.contains(name) {
				c.Changed = append(c.Changed, name)
			} else {
				c.Added = append(c.Added, name)
			}
		}
	}
	for _, name := range v.paths() {
		if _, ok := payload[name]; !ok {
			c.Removed = append(c.Removed, name)
		}
	}
	kept := directories(payload)
	for dir := range v.dirs() {
		if !kept[dir] {
			c.RemovedDirs = append(c.RemovedDirs, dir)
		}
	}
	slices.Sort(c.Added)
	slices.Sort(c.Changed)
	slices.Sort(c.RemovedDirs)
	return c
}

// contains reports whether v has a file at path p.
func (v *version) contains(p string) bool {
	if v.payload == nil && v.manifest != nil {
		_, ok := v.manifest.index[p]
		return ok
	}
	_, ok := v.payload[p]
	return ok
}

// forget drops what v holds in memory of its files, keeping their count:
// its manifest on disk says the rest (AtomicWriter.recall).
func (v *version) forget() {
	v.count = v.files()
	if v.manifest != nil {
		v.digest = v.manifest.Digest
	}
	v.payload, v.manifest, v.forgotten = nil, nil, true
}
