package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/untrusted"
)

// What the atomic writer does with a mount directory it did not just write:
// adopt a previous run's content, remove strays, verify against the disk,
// tear down.

// Adoption tells how Adopt took over a version.
type Adoption struct {
	// Version is the version directory adopted, "" when there was none.
	Version string
	// Files is how many files it holds.
	Files int
	// FromManifest reports that it was adopted from its manifest (one
	// fstat per file); otherwise every file was read. Its bytes are then
	// compared by the next Verify.
	FromManifest bool
	// ManifestErr says why the manifest was not used, when a version
	// was adopted by reading: errNoManifest (an older kvmount's
	// version, a torn manifest), or ErrDrift when it did not match the
	// disk.
	ManifestErr error
	// Removed names the entries AdoptOwned removed, sorted.
	Removed []string
	// Left names the entries that were to go — strays, leftovers of an
	// interrupted write — but that the rights removals take in a mount
	// someone else can write could not remove (see removeTree), sorted;
	// LeftErr says why. They stay, and are not taken for content.
	Left    []string
	LeftErr error
}

// Adopt inspects the mount directory and takes over what a previous run
// left: it refuses entries the atomic writer would not have made
// (ErrForeignContent), removes crash leftovers (a stale ..data_tmp,
// version directories that ..data does not point at) and takes the current
// version as it is — from its manifest when that matches the disk (one
// fstat per file, no byte read), else by reading every file. An unreadable
// version is no error: the next Write rewrites everything.
func (w *AtomicWriter) Adopt() (Adoption, error) {
	entries, err := w.list()
	if err != nil {
		return Adoption{}, err
	}
	w.left, w.leftErr = nil, nil
	ad, err := w.adopt(entries)
	ad.Left, ad.LeftErr = w.leftNames(), w.leftErr
	return ad, err
}

// Left returns the entries of the mount directory that the last adoption
// or teardown could not remove with the rights removals take there (see
// removeTree), sorted, and why.
func (w *AtomicWriter) Left() ([]string, error) { return w.leftNames(), w.leftErr }

// leftNames returns the names in w.left, sorted.
func (w *AtomicWriter) leftNames() []string {
	return slices.Sorted(maps.Keys(w.left))
}

// AdoptOwned is Adopt for a mount directory kvmount owns: it first
// removes every entry the atomic writer would not have made (a file added
// by hand, a visible name replaced by a regular file: drift there) and
// names them, sorted, in Adoption.Removed. Entries are removed through the
// writer's os.Root, so that a planted symlink is removed itself and never
// followed. The directory is listed once for both steps.
func (w *AtomicWriter) AdoptOwned() (Adoption, error) {
	entries, err := w.list()
	if err != nil {
		return Adoption{}, err
	}
	w.left, w.leftErr = nil, nil
	kept, removed := w.removeStrays(entries)
	ad, err := w.adopt(kept)
	ad.Removed = removed
	ad.Left, ad.LeftErr = w.leftNames(), w.leftErr
	return ad, err
}

// adopt is Adopt over entries, the mount directory's.
func (w *AtomicWriter) adopt(entries []mountEntry) (Adoption, error) {
	var foreign []string
	visible := map[string]bool{}
	current := ""
	for _, e := range entries {
		switch {
		case e.name == DataDirName || e.name == dataTmpName || isVersionName(e.name):
			if !e.isWriters() {
				foreign = append(foreign, e.name)
			}
			if e.name == DataDirName && isVersionName(e.target) {
				current = e.target
			}
		case !e.isVisibleLink():
			foreign = append(foreign, e.name)
		default:
			visible[e.name] = true
		}
	}
	if len(foreign) > 0 {
		if len(foreign) > 5 {
			foreign = append(foreign[:5], "...")
		}
		return Adoption{}, fmt.Errorf("atomic writer: %s: %w: %s", w.dir, ErrForeignContent, strings.Join(foreign, ", "))
	}
	if err := w.removeLeftoversOf(entries, current); err != nil {
		return Adoption{}, err
	}
	w.adopted = true
	w.current, w.retired = nil, nil
	w.setVisible(nil)
	if current == "" {
		w.setVisible(visible)
		return Adoption{}, nil
	}
	ad := Adoption{Version: current}
	if v, err := w.adoptManifest(current); err == nil {
		w.current = v
		w.setVisible(visible)
		ad.FromManifest, ad.Files = true, v.files()
		return ad, nil
	} else {
		ad.ManifestErr = err
	}
	payload, dirsMatch, err := w.readVersion(current)
	if err != nil {
		// An unreadable version is not an error: the next Write
		// rewrites every file.
		return ad, nil
	}
	w.current = &version{name: current, payload: payload, noManifest: true}
	w.rebuildDirs = !dirsMatch
	w.setVisible(visible)
	ad.Files = len(payload)
	return ad, nil
}

// removeStrays removes the entries that are not the writer's
// (mountEntry.isWriters) and returns those kept and the names removed, in
// the order of entries.
func (w *AtomicWriter) removeStrays(entries []mountEntry) (kept []mountEntry, removed []string) {
	for _, e := range entries {
		if e.isWriters() {
			kept = append(kept, e)
			continue
		}
		if err := w.removeTree(w.mount, e.name, true); err != nil {
			w.leave(e.name, err)
			continue
		}
		removed = append(removed, e.name)
	}
	if len(removed) > 0 {
		w.setVisible(nil)
	}
	return kept, removed
}

// leave records that the entry name of the mount directory stays, though
// it was to go, because removing it failed with err (see Adoption.Left).
func (w *AtomicWriter) leave(name string, err error) {
	if w.left == nil {
		w.left = map[string]bool{}
	}
	w.left[name] = true
	w.leftErr = errors.Join(w.leftErr, err)
}

// Verify compares the mount directory with the version last written or
// adopted: ..data, every file's bytes, mode and owner, and the visible
// symlinks. It returns nil when they match, or an error wrapping ErrDrift
// that names the first difference; the next Write then rewrites every file.
func (w *AtomicWriter) Verify() error {
	if err := w.verify(); err != nil {
		w.current = nil
		w.setVisible(nil)
		return fmt.Errorf("atomic writer: %s: %w: %v", w.dir, ErrDrift, err)
	}
	return nil
}

func (w *AtomicWriter) verify() error {
	if err := w.sameDir(); err != nil {
		return err
	}
	if w.current == nil {
		return errors.New("no known version")
	}
	target, err := w.root.Readlink(DataDirName)
	if err != nil {
		return err
	}
	if target != w.current.name {
		return fmt.Errorf("%s points at %q, want %q", DataDirName, target, w.current.name)
	}
	if w.current.forgotten {
		// Forgotten after its write (ForgetPayload): every byte is
		// compared with the hashes of its manifest, which root alone can
		// write; what matches is the payload written.
		if !w.recallCurrent() {
			return errors.New("the manifest of the current version cannot be read")
		}
		disk, _, err := w.readVersion(target)
		if err == nil {
			err = w.current.manifest.sameBytes(disk)
		}
		if err != nil {
			w.dropManifest(target)
			return err
		}
		w.current.payload, w.current.manifest = disk, nil
	} else if w.current.payload == nil {
		// Known from its manifest only (no Write since Adopt): compare
		// that with the disk again.
		_, err := w.adoptManifest(target)
		return err
	} else if err := w.sameAsPayload(target); err != nil {
		return err
	}
	if err := w.checkManifest(); err != nil {
		return err
	}
	want := topLevel(w.current.payload)
	entries, err := w.list()
	if err != nil {
		return err
	}
	for _, e := range entries {
		name := e.name
		if name == DataDirName || name == w.current.name || w.isRetired(name) || w.left[name] {
			continue
		}
		if !want[name] {
			return fmt.Errorf("unexpected entry %s", name)
		}
		if !e.isVisibleLink() {
			return fmt.Errorf("%s is not a symlink to %s/%s", name, DataDirName, name)
		}
		delete(want, name)
	}
	for name := range want {
		return fmt.Errorf("visible entry %s is missing", name)
	}
	return nil
}

// sameAsPayload compares the version target, the current one, byte for
// byte with its payload.
func (w *AtomicWriter) sameAsPayload(target string) error {
	disk, _, err := w.readVersion(target)
	if err != nil {
		w.dropManifest(target)
		return err
	}
	for _, name := range w.current.payload.Paths() {
		got, ok := disk[name]
		if !ok {
			w.dropManifest(target)
			return fmt.Errorf("%s is missing", untrusted.Escape(name))
		}
		if !got.Equal(w.current.payload[name]) {
			// The bytes read overrule the manifest, which still matches
			// by size, mode, owner and inode: an edit in place.
			w.dropManifest(target)
			return fmt.Errorf("%s differs", untrusted.Escape(name))
		}
	}
	if len(disk) != len(w.current.payload) {
		w.dropManifest(target)
		return fmt.Errorf("version holds %d files, want %d", len(disk), len(w.current.payload))
	}
	return nil
}

// sameDir checks that the mount directory's path still reaches the
// directory the writer holds, without following a symlink in any
// component: removed or replaced by hand, the writer would otherwise write
// into a directory nobody sees. Whether a replacement may be taken over is
// not the writer's call: a reopen decides (Medium.Prepare).
func (w *AtomicWriter) sameDir() error {
	st, err := fsutil.StatDir(w.dir)
	if err != nil {
		return fmt.Errorf("mount directory: %w", err)
	}
	// The same inode of the same mounted file system: both are of this
	// boot, so st_dev serves (fsutil.Ident's f_fsid is for what outlives
	// a reboot), and no fstatfs(2) is needed on each write.
	if st.Dev != w.dev || st.Ino != w.ino {
		return errors.New("mount directory was removed or replaced")
	}
	w.owned = st.Uid == uint32(w.uid)
	return nil
}

// versionsMayInherit reports whether a new version directory may have
// inherited a POSIX ACL from the mount directory (acl(5): a directory's
// default ACL becomes the access and default ACL of what is created in
// it), and so has it removed (fsutil.StripACL) before anything is written
// in it. It may not when the mount directory had no default ACL when the
// writer opened it and is, at this write (sameDir), owned by the writer's
// own user: only a file's owner, or a process with CAP_FOWNER, sets its
// ACLs (setxattr(2) of system.posix_acl_default checks
// inode_owner_or_capable), so no other user can have added one since.
// That takes two fremovexattr(2) off each write of a mount of root's.
func (w *AtomicWriter) versionsMayInherit() bool { return w.defaultACL || !w.owned }

// Teardown removes everything the writer made: the visible symlinks, ..data,
// ..data_tmp and every version directory. Foreign entries are left alone,
// and so is a version directory that the rights of removals cannot remove
// (see removeTree; Left names them). The mount directory itself stays; the
// caller removes it if it made it.
func (w *AtomicWriter) Teardown() error {
	entries, err := w.list()
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		name := e.name
		var err error
		switch {
		case name == DataDirName || name == dataTmpName:
			err = w.root.Remove(name)
		case isVersionName(name):
			if err = w.removeTree(w.mount, name, true); err != nil {
				w.leave(name, err)
				err = nil
			}
		case e.isVisibleLink():
			err = w.root.Remove(name)
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	w.current, w.retired = nil, nil
	errs = append(errs, w.pruneManifests())
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("atomic writer: teardown %s: %w", w.dir, err)
	}
	return nil
}

// scanVisible returns the entries of the mount directory that are the
// writer's visible symlinks.
func (w *AtomicWriter) scanVisible() (map[string]bool, error) {
	entries, err := w.list()
	if err != nil {
		return nil, err
	}
	found := map[string]bool{}
	for _, e := range entries {
		if e.isVisibleLink() {
			found[e.name] = true
		}
	}
	return found, nil
}

// removeLeftovers removes ..data_tmp and every version directory other than
// keep: what a crash or an earlier write left behind.
func (w *AtomicWriter) removeLeftovers(keep string) error {
	names, err := w.listHidden()
	if err != nil {
		return err
	}
	entries := make([]mountEntry, len(names))
	for i, name := range names {
		entries[i].name = name
	}
	return w.removeLeftoversOf(entries, keep)
}

// listHidden returns the names in the mount directory that begin with
// "..": ..data, ..data_tmp and the version directories, never a visible
// name (CleanPath refuses a first element that begins with ".."). Unlike
// list it reads no symlink and keeps no other name: it is what
// removeLeftovers needs after a writer's first switch, which a cold start
// makes for every mount, and list made 300 objects of garbage for a
// 100-file mount (BENCHMARKS.md, "The monitor's heap after a cold
// start").
func (w *AtomicWriter) listHidden() ([]string, error) {
	// A description of its own: reading entries moves its offset.
	fd, err := unix.Openat(int(w.mount.Fd()), ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: list %s: %w", w.dir, err)
	}
	defer unix.Close(fd)
	var names []string
	buf := make([]byte, 8192)
	for {
		n, err := unix.ReadDirent(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("atomic writer: list %s: %w", w.dir, err)
		}
		if n <= 0 {
			return names, nil
		}
		start := len(names)
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
		kept := slices.DeleteFunc(names[start:], func(name string) bool { return !strings.HasPrefix(name, "..") })
		names = names[:start+len(kept)]
	}
}

// removeLeftoversOf is removeLeftovers over entries, the mount directory's.
// A version directory that the rights of removals cannot remove (see
// removeTree) stays, in w.left.
func (w *AtomicWriter) removeLeftoversOf(entries []mountEntry, keep string) error {
	for _, e := range entries {
		name := e.name
		var err error
		switch {
		case name == dataTmpName:
			err = w.root.Remove(name)
		case isVersionName(name) && name != keep:
			if err = w.removeTree(w.mount, name, true); err != nil {
				w.leave(name, err)
				continue
			}
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("atomic writer: remove leftover: %w", err)
		}
	}
	if keep == "" {
		return w.pruneManifests()
	}
	return w.pruneManifests(keep)
}

// isVisibleLink reports whether name is a symlink to ..data/name, as the
// writer makes them.
func (w *AtomicWriter) isVisibleLink(name string) bool {
	target, err := w.root.Readlink(name)
	return err == nil && target == path.Join(DataDirName, name)
}

// A mountEntry is an entry of the mount directory as list found it.
type mountEntry struct {
	name string
	// typ is the entry's type bits (fs.ModeType).
	typ fs.FileMode
	// target is a symlink's target, "" for anything else.
	target string
}

// isVisibleLink reports whether e is a symlink to ..data/<its name>, as
// the writer makes them.
func (e mountEntry) isVisibleLink() bool {
	return !strings.HasPrefix(e.name, "..") && e.typ&fs.ModeSymlink != 0 && e.target == path.Join(DataDirName, e.name)
}

// isWriters reports whether e has a name and type the atomic writer
// makes: ..data and ..data_tmp as symlinks, version directories, and
// visible symlinks.
func (e mountEntry) isWriters() bool {
	switch {
	case e.name == DataDirName || e.name == dataTmpName:
		return e.typ&fs.ModeSymlink != 0
	case isVersionName(e.name):
		return e.typ.IsDir()
	}
	return e.isVisibleLink()
}

// list returns the entries of the mount directory, sorted by name, with
// their types and their symlinks' targets, all read relative to a handle
// on the directory: the types as the directory gives them (getdents'
// d_type, or an fstatat relative to the handle where the file system gives
// none), the targets with readlinkat. os.Root's ReadDir stats every entry,
// and its Readlink resolves each name anew: at a restart with 1,000 mounts
// of 100 files, listing cost 1.25 s of CPU that way (BENCHMARKS.md,
// "Restart at scale").
func (w *AtomicWriter) list() ([]mountEntry, error) {
	f, err := w.root.Open(".")
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	// A handle opened through an os.Root stats every entry it lists; a
	// duplicate of it is a plain handle on the same directory.
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("atomic writer: list %s: %w", w.dir, err)
	}
	d := os.NewFile(uintptr(fd), w.dir)
	defer d.Close()
	des, err := d.ReadDir(-1)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: list %s: %w", w.dir, err)
	}
	entries := make([]mountEntry, 0, len(des))
	buf := make([]byte, unix.PathMax)
	for _, de := range des {
		// Only the name and type: de.Info would stat the entry by path.
		e := mountEntry{name: de.Name(), typ: de.Type()}
		if e.typ&fs.ModeSymlink != 0 {
			if n, err := unix.Readlinkat(fd, e.name, buf); err == nil {
				e.target = string(buf[:n])
			}
		}
		entries = append(entries, e)
	}
	slices.SortFunc(entries, func(a, b mountEntry) int { return strings.Compare(a.name, b.name) })
	return entries, nil
}

// Keep takes the current version as the projection of the payload whose
// digest (Payload.Digest) is digest, without that payload's bytes: for a
// restart whose source says the payload is the one a previous run wrote,
// so that it crosses neither the socket from the worker nor a hash here.
// The current version must have been adopted from its manifest, whose
// files matched the disk by one fstat each (Adoption.FromManifest), and
// the manifest must record digest; Keep then does what Write of that
// payload does when it finds it on disk — the visible symlinks become
// exactly the version's first path elements — and nothing else: no
// version is built, no check runs. Its bytes are read back by the next
// Verify, as after any adoption from a manifest.
//
// It returns an error wrapping ErrNotKept when the version is not known
// so (none, adopted by reading its files, another digest, directories to
// rebuild), an error wrapping fsutil.ErrReplaced when the mount
// directory's path no longer reaches the directory held (as Write), or
// the error of a symlink's creation or removal.
func (w *AtomicWriter) Keep(digest string) error {
	v := w.current
	if v == nil || v.manifest == nil || v.payload != nil || v.manifest.Digest != digest || w.rebuildDirs || digest == "" {
		return fmt.Errorf("atomic writer: %s: %w", w.dir, ErrNotKept)
	}
	if err := w.sameDir(); err != nil {
		return fmt.Errorf("atomic writer: %s: %w: %v", w.dir, fsutil.ErrReplaced, err)
	}
	want := v.topLevel()
	if err := w.addVisible(want); err != nil {
		return err
	}
	return w.removeStaleVisible(want)
}

// Size returns the bytes of the current version's files, as its payload or
// its manifest records them; -1 when the writer does not hold either (no
// version, or one forgotten: ForgetPayload).
func (w *AtomicWriter) Size() int64 {
	v := w.current
	switch {
	case v == nil || v.forgotten:
		return -1
	case v.payload == nil && v.manifest != nil:
		var n int64
		for _, e := range v.manifest.Files {
			n += e.Size
		}
		return n
	}
	return v.payload.Size()
}
