package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"path"
	"strings"
	"syscall"

	"github.com/kvmount/kvmount/fsutil"
)

// What the atomic writer does with a mount directory it did not just write:
// adopt a previous run's content, remove strays, verify against the disk,
// tear down.

// Adopt inspects the mount directory and takes over what a previous run left:
// it refuses entries the atomic writer would not have made (ErrForeignContent),
// removes crash leftovers (a stale ..data_tmp, version directories that ..data
// does not point at) and reads the current version byte for byte. It returns
// the payload on disk, or nil when the directory is empty or its version is
// unreadable (the next Write then rewrites everything).
func (w *AtomicWriter) Adopt() (Payload, error) {
	entries, err := w.readDir(".")
	if err != nil {
		return nil, err
	}
	var foreign []string
	for _, e := range entries {
		if !w.isWritersEntry(e) {
			foreign = append(foreign, e.Name())
		}
	}
	if len(foreign) > 0 {
		if len(foreign) > 5 {
			foreign = append(foreign[:5], "...")
		}
		return nil, fmt.Errorf("atomic writer: %s: %w: %s", w.dir, ErrForeignContent, strings.Join(foreign, ", "))
	}
	current, _ := w.root.Readlink(DataDirName)
	if !isVersionName(current) {
		current = ""
	}
	if err := w.removeLeftovers(current); err != nil {
		return nil, err
	}
	w.adopted = true
	w.current, w.retired = nil, nil
	w.visible = nil
	if current == "" {
		return nil, nil
	}
	payload, err := w.readVersion(current)
	if err != nil {
		// An unreadable version is not an error: the next Write
		// rewrites every file.
		return nil, nil
	}
	w.current = &version{name: current, payload: payload}
	w.rebuildDirs = !w.dirsMatch(current)
	return payload, nil
}

// RemoveStrays removes every entry of the mount directory that the atomic
// writer would not have made — a file added by hand, a visible name
// replaced by a regular file — and returns their names, sorted. Only for a
// mount directory kvmount owns: there, such entries are drift. Entries are
// removed through the writer's os.Root, so a planted symlink is removed
// itself, never followed.
func (w *AtomicWriter) RemoveStrays() ([]string, error) {
	entries, err := w.readDir(".")
	if err != nil {
		return nil, err
	}
	var removed []string
	for _, e := range entries {
		if name := e.Name(); !w.isWritersEntry(e) {
			if err := w.root.RemoveAll(name); err != nil {
				return removed, fmt.Errorf("atomic writer: remove stray entry: %w", err)
			}
			removed = append(removed, name)
		}
	}
	if len(removed) > 0 {
		w.visible = nil
	}
	return removed, nil
}

// isWritersEntry reports whether the entry e of the mount directory has a
// name and type the atomic writer makes.
func (w *AtomicWriter) isWritersEntry(e fs.DirEntry) bool {
	name := e.Name()
	switch {
	case name == DataDirName || name == dataTmpName:
		return e.Type()&fs.ModeSymlink != 0
	case isVersionName(name):
		return e.IsDir()
	case strings.HasPrefix(name, ".."):
		return false
	}
	return w.isVisibleLink(name)
}

// dirsMatch reports whether the version directory name and every
// directory inside it have the writer's mode and owner.
func (w *AtomicWriter) dirsMatch(name string) bool {
	match := true
	_ = fs.WalkDir(w.root.FS(), name, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			match = false
			return fs.SkipAll
		}
		if !d.IsDir() {
			return nil
		}
		info, err := w.root.Lstat(p)
		if err != nil {
			match = false
			return fs.SkipAll
		}
		st, ok := info.Sys().(*syscall.Stat_t)
		if info.Mode().Perm() != w.opts.DirMode.Perm() || !ok ||
			w.opts.DirUID >= 0 && int(st.Uid) != w.opts.DirUID || w.opts.DirGID >= 0 && int(st.Gid) != w.opts.DirGID {
			match = false
			return fs.SkipAll
		}
		return nil
	})
	return match
}

// Verify compares the mount directory with the version last written or
// adopted: ..data, every file's bytes, mode and owner, and the visible
// symlinks. It returns nil when they match, or an error wrapping ErrDrift
// that names the first difference; the next Write then rewrites every file.
func (w *AtomicWriter) Verify() error {
	if err := w.verify(); err != nil {
		w.current = nil
		w.visible = nil
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
	disk, err := w.readVersion(target)
	if err != nil {
		return err
	}
	for _, name := range w.current.payload.Paths() {
		got, ok := disk[name]
		if !ok {
			return fmt.Errorf("%s is missing", name)
		}
		if !got.Equal(w.current.payload[name]) {
			return fmt.Errorf("%s differs", name)
		}
	}
	if len(disk) != len(w.current.payload) {
		return fmt.Errorf("version holds %d files, want %d", len(disk), len(w.current.payload))
	}
	want := topLevel(w.current.payload)
	entries, err := w.readDir(".")
	if err != nil {
		return err
	}
	for _, e := range entries {
		name := e.Name()
		if name == DataDirName || name == w.current.name || w.isRetired(name) {
			continue
		}
		if !want[name] {
			return fmt.Errorf("unexpected entry %s", name)
		}
		if !w.isVisibleLink(name) {
			return fmt.Errorf("%s is not a symlink to %s/%s", name, DataDirName, name)
		}
		delete(want, name)
	}
	for name := range want {
		return fmt.Errorf("visible entry %s is missing", name)
	}
	return nil
}

// sameDir checks that the mount directory's path still reaches the
// directory the writer holds, without following a symlink in any
// component: removed or replaced by hand, the writer would otherwise write
// into a directory nobody sees. Whether a replacement may be taken over is
// not the writer's call: a reopen decides (Medium.Prepare).
func (w *AtomicWriter) sameDir() error {
	d, err := fsutil.OpenDir(w.dir)
	if err != nil {
		return fmt.Errorf("mount directory: %w", err)
	}
	defer d.Close()
	ident, err := fsutil.IdentOf(d)
	if err != nil {
		return fmt.Errorf("mount directory: %w", err)
	}
	if ident != w.ident {
		return errors.New("mount directory was removed or replaced")
	}
	return nil
}

// Teardown removes everything the writer made: the visible symlinks, ..data,
// ..data_tmp and every version directory. Foreign entries are left alone.
// The mount directory itself stays; the caller removes it if it made it.
func (w *AtomicWriter) Teardown() error {
	entries, err := w.readDir(".")
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		name := e.Name()
		var err error
		switch {
		case name == DataDirName || name == dataTmpName:
			err = w.root.Remove(name)
		case isVersionName(name):
			err = w.root.RemoveAll(name)
		case w.isVisibleLink(name):
			err = w.root.Remove(name)
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	w.current, w.retired = nil, nil
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("atomic writer: teardown %s: %w", w.dir, err)
	}
	return nil
}

// scanVisible returns the entries of the mount directory that are the
// writer's visible symlinks.
func (w *AtomicWriter) scanVisible() (map[string]bool, error) {
	entries, err := w.readDir(".")
	if err != nil {
		return nil, err
	}
	found := map[string]bool{}
	for _, e := range entries {
		if name := e.Name(); !strings.HasPrefix(name, "..") && e.Type()&fs.ModeSymlink != 0 && w.isVisibleLink(name) {
			found[name] = true
		}
	}
	return found, nil
}

// removeLeftovers removes ..data_tmp and every version directory other than
// keep: what a crash or an earlier write left behind.
func (w *AtomicWriter) removeLeftovers(keep string) error {
	entries, err := w.readDir(".")
	if err != nil {
		return err
	}
	for _, e := range entries {
		name := e.Name()
		var err error
		switch {
		case name == dataTmpName:
			err = w.root.Remove(name)
		case isVersionName(name) && name != keep:
			err = w.root.RemoveAll(name)
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("atomic writer: remove leftover: %w", err)
		}
	}
	return nil
}

// readVersion reads every file of the version directory name. Anything but
// regular files and directories inside it is an error.
func (w *AtomicWriter) readVersion(name string) (Payload, error) {
	payload := Payload{}
	err := fs.WalkDir(w.root.FS(), name, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("%s is not a regular file", p)
		}
		info, err := w.root.Lstat(p)
		if err != nil {
			return err
		}
		data, err := w.root.ReadFile(p)
		if err != nil {
			return err
		}
		f := File{Data: data, Mode: info.Mode().Perm(), UID: -1, GID: -1}
		if st, ok := info.Sys().(*syscall.Stat_t); ok {
			f.UID, f.GID = int(st.Uid), int(st.Gid)
		}
		payload[strings.TrimPrefix(p, name+"/")] = f
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("atomic writer: read version: %w", err)
	}
	return payload, nil
}

// isVisibleLink reports whether name is a symlink to ..data/name, as the
// writer makes them.
func (w *AtomicWriter) isVisibleLink(name string) bool {
	target, err := w.root.Readlink(name)
	return err == nil && target == path.Join(DataDirName, name)
}

func (w *AtomicWriter) readDir(name string) ([]fs.DirEntry, error) {
	entries, err := fs.ReadDir(w.root.FS(), name)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	return entries, nil
}
