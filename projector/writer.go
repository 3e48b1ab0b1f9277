package projector

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math/big"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// Names of the atomic writer's layout inside a mount directory, the kubelet's
// (pkg/volume/util/atomic_writer.go).
const (
	// DataDirName is the symlink that points at the current version directory.
	DataDirName = "..data"
	// dataTmpName is the symlink that is renamed over DataDirName.
	dataTmpName = "..data_tmp"
	// versionTimeLayout is the UTC timestamp in a version directory's name.
	versionTimeLayout = "2006_01_02_15_04_05"
)

// Errors returned by the AtomicWriter.
var (
	// ErrForeignContent means the mount directory holds entries that the
	// atomic writer did not make; kvmount refuses to write into it.
	ErrForeignContent = errors.New("directory holds files that kvmount did not write")
	// ErrDrift means the mount directory no longer matches what was written:
	// something changed it by hand.
	ErrDrift = errors.New("mount directory differs from the projected version")
	// ErrCheckFailed wraps the error of a Check that refused a new
	// version; the current version stays.
	ErrCheckFailed = errors.New("check of the new version failed")
	// ErrVersionVanished means the new version directory disappeared
	// before or during the switch — another process changed the mount
	// directory. ..data is never left naming a missing version.
	ErrVersionVanished = errors.New("the new version directory vanished")
)

// DefaultGrace is how long the previous version stays after a switch by
// default (WriterOptions.Grace).
const DefaultGrace = 5 * time.Second

// WriterOptions configure an AtomicWriter.
type WriterOptions struct {
	// Sync makes the writer fsync every new file and directory and the mount
	// directory around the switch, so that a version survives power loss
	// (medium disk). tmpfs has nothing to sync.
	Sync bool
	// DirMode is the permission of version directories and the directories
	// inside them; zero means 0o755, the kubelet's.
	DirMode fs.FileMode
	// DirUID and DirGID own version directories, inner directories and the
	// visible symlinks; -1 leaves them to kvmount's own user or group.
	DirUID, DirGID int
	// Check, when set, is called with the absolute path of each new
	// version directory, complete and synced, before the switch. An error
	// keeps the current version: Write removes the new one and returns the
	// error wrapped with ErrCheckFailed.
	Check func(versionDir string) error
	// Grace is how long a replaced version directory stays after a
	// switch, so that a reader that resolved ..data just before it can
	// still open its files (git-sync keeps its old worktree likewise). A
	// replaced version is removed by a later Write or by Collect once
	// Grace has passed — but at most MaxRetired replaced versions are
	// kept: under back-to-back writes the oldest goes first, whatever its
	// age; and a Write that finds the file system full removes them all.
	// Zero means DefaultGrace.
	Grace time.Duration
}

// MaxRetired is how many replaced versions an AtomicWriter keeps at most
// for readers during their grace period; beyond it the oldest goes first.
// A reader descheduled in the middle of a path lookup can miss several
// back-to-back writes (measured: two kept versions still let 2 reads in
// 200,000 fail), so the bound is time (Grace) far more than count. A build
// that finds the file system full (ENOSPC) removes the replaced versions
// and is tried once more: a tmpfs sized for three versions never fails a
// write because of them. (Checking free space before each build instead
// cost 0.3 ms per write on ext4, measured: statfs is not cheap there.)
const MaxRetired = 16

// AtomicWriter writes payloads into one mount directory so that readers move
// from one complete version to the next in a single rename, the kubelet's
// AtomicWriter with kvmount's improvements. The layout is:
//
//	..2026_11_22_01_02_03.123456789/   one version: the files of a payload
//	..data -> ..2026_11_22_01_02_03.123456789
//	app.conf -> ..data/app.conf       one symlink per first path element
//
// Write proceeds in these steps:
//
//  1. Validate every path (CleanPath).
//  2. Compare the payload with the current version (data, mode, owner). When
//     nothing changed, return; after Adopt, first re-create visible symlinks
//     a crash left missing (kubernetes#121472).
//  3. Create a new version directory ..<UTC time>.<random>; write files that
//     changed with exclusive create (never through a symlink), chmod and chown
//     the open file, fsync it when Sync is set; hard-link unchanged files
//     from the current version. fsync the new directories.
//  4. Create the visible symlinks of new first path elements; they dangle
//     until the switch. (The kubelet creates them after the switch, so a
//     crash in between leaves names of the current version invisible.)
//  5. Point ..data_tmp at the new version and rename it over ..data: the one
//     atomic switch. fsync the mount directory.
//  6. Remove the visible symlinks no longer in the payload. The previous
//     version directory stays for WriterOptions.Grace, so that a reader that
//     resolved ..data a moment before the switch still finds its files
//     (the kubelet removes it at once); the version before it, if still
//     there, is removed now.
//
// The switch never points ..data at a version directory that does not
// exist: the new directory is checked to be the one built just before and
// just after the rename, and a vanished one is an ErrVersionVanished with
// the previous version restored.
//
// Every operation goes through an os.Root opened on the mount directory, or
// through a directory handle opened from it without following symlinks with
// a single path element, so nothing outside the mount directory is ever
// created, changed or removed. An AtomicWriter is not safe for concurrent
// use; one writer owns a mount directory.
type AtomicWriter struct {
	dir     string
	root    *os.Root
	opts    WriterOptions
	adopted bool
	// current is the version on disk, or nil when the directory is empty or
	// its content is unknown (after drift), which makes the next Write
	// rewrite every file.
	current *version
	// retired are the replaced versions kept for readers, oldest first,
	// each until its retiredAt + Grace.
	retired []retiredVersion
	// rebuildDirs is set when the current version's directories do not
	// have the configured mode or owner: the next Write builds a new
	// version even if the payload is unchanged.
	rebuildDirs bool
	// visible holds the first path elements known to have their symlink,
	// or nil when unknown (after Adopt or drift), which makes the next
	// write check every entry of the mount directory.
	visible map[string]bool
	uid     int
	gid     int
}

// retiredVersion is a replaced version and when it was replaced.
type retiredVersion struct {
	*version
	at time.Time
}

// version is one version directory and the payload it holds.
type version struct {
	name    string
	payload Payload
}

// OpenAtomicWriter returns a writer for the existing directory dir. It reads
// nothing yet; Adopt or the first Write inspects the directory. The writer
// holds dir open until Close.
//
// dir is opened without following a symlink at its last element
// (fsutil.OpenDir): a mount directory replaced by a symlink is refused with
// an error wrapping fsutil.ErrNotDir, and nothing behind the symlink is
// read or touched.
func OpenAtomicWriter(dir string, opts WriterOptions) (*AtomicWriter, error) {
	d, err := fsutil.OpenDir(dir)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	defer d.Close()
	root, err := os.OpenRoot(fsutil.ProcPath(d))
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	if opts.DirMode == 0 {
		opts.DirMode = 0o755
	}
	if opts.Grace <= 0 {
		opts.Grace = DefaultGrace
	}
	return &AtomicWriter{dir: dir, root: root, opts: opts, uid: os.Geteuid(), gid: os.Getegid()}, nil
}

// SetCheck replaces WriterOptions.Check for the following writes.
func (w *AtomicWriter) SetCheck(check func(versionDir string) error) { w.opts.Check = check }

// Files returns how many files the current version holds: 0 when the
// mount is empty or its content is unknown.
func (w *AtomicWriter) Files() int {
	if w.current == nil {
		return 0
	}
	return len(w.current.payload)
}

// Version returns the name of the current version directory, or "" when none
// is known.
func (w *AtomicWriter) Version() string {
	if w.current == nil {
		return ""
	}
	return w.current.name
}

// Close releases the mount directory.
func (w *AtomicWriter) Close() error { return w.root.Close() }

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

// Write projects payload into the mount directory (see AtomicWriter for the
// steps) and returns what changed. Nothing is written when data, modes and
// owners are unchanged. On error the previous version stays in place and
// visible; a partly built version directory is removed.
func (w *AtomicWriter) Write(payload Payload) (Change, error) {
	payload, err := cleanPayload(payload)
	if err != nil {
		return Change{}, err
	}
	if !w.adopted {
		if _, err := w.Adopt(); err != nil {
			return Change{}, err
		}
	}
	var old Payload
	if w.current != nil {
		old = w.current.payload
		if old.Equal(payload) && !w.rebuildDirs {
			if err := w.addVisible(payload); err != nil {
				return Change{}, err
			}
			return Change{}, w.removeStaleVisible(payload)
		}
	}
	change := Diff(old, payload)
	oldDirs := dirHandles{}
	defer oldDirs.close()
	name, built, err := w.buildVersion(payload, oldDirs)
	if errors.Is(err, syscall.ENOSPC) && len(w.retired) > 0 {
		// The file system is full: the replaced versions kept for
		// readers give way, and the build is tried once more.
		if rerr := w.RemoveReplaced(); rerr != nil {
			return Change{}, rerr
		}
		name, built, err = w.buildVersion(payload, oldDirs)
	}
	if err != nil {
		return Change{}, err
	}
	if w.opts.Check != nil {
		if err := w.opts.Check(filepath.Join(w.dir, name)); err != nil {
			_ = w.root.RemoveAll(name)
			return Change{}, fmt.Errorf("atomic writer: %w: %w", ErrCheckFailed, err)
		}
	}
	// New visible names dangle until the switch, then resolve: a crash at
	// any point leaves every name of the current version visible.
	if err := w.addVisible(payload); err != nil {
		_ = w.root.RemoveAll(name)
		return Change{}, err
	}
	switched, err := w.switchTo(name, built)
	if !switched {
		_ = w.root.RemoveAll(name)
		return Change{}, err
	}
	previous := w.current
	w.current = &version{name: name, payload: payload}
	w.rebuildDirs = false
	if err != nil {
		// Switched, but not durable (fsync failed): the new version is
		// what readers see, so it stays; the caller retries.
		w.retire(previous, oldDirs)
		return change, err
	}
	if err := w.removeStaleVisible(payload); err != nil {
		return change, err
	}
	if previous == nil {
		// Unknown leftovers (after drift or on the first write): scan.
		w.retired = nil
		return change, w.removeLeftovers(name)
	}
	return change, w.retire(previous, oldDirs)
}

// retire keeps previous as a version readers may still be in, then removes
// replaced versions whose grace period is over and, beyond MaxRetired, the
// oldest. dirs holds previous's directories open.
func (w *AtomicWriter) retire(previous *version, dirs dirHandles) error {
	now := time.Now()
	if previous != nil {
		w.retired = append(w.retired, retiredVersion{version: previous, at: now})
	}
	var errs []error
	for len(w.retired) > 0 && (len(w.retired) > MaxRetired || !now.Before(w.retired[0].at.Add(w.opts.Grace))) {
		v := w.retired[0]
		w.retired = w.retired[1:]
		h := dirHandles{}
		if v.version == previous {
			h = dirs
		}
		errs = append(errs, w.removeVersion(v.version, h))
	}
	return errors.Join(errs...)
}

// Collect removes the replaced versions whose grace period
// (WriterOptions.Grace) has passed at now. It returns when the next one
// will be due, or the zero time when none is kept.
func (w *AtomicWriter) Collect(now time.Time) (time.Time, error) {
	var errs []error
	for len(w.retired) > 0 && !now.Before(w.retired[0].at.Add(w.opts.Grace)) {
		v := w.retired[0]
		w.retired = w.retired[1:]
		errs = append(errs, w.removeVersion(v.version, dirHandles{}))
	}
	return w.CollectDue(), errors.Join(errs...)
}

// RemoveReplaced removes every replaced version now, whatever its grace
// period: for a clean stop, which leaves one version per mount.
func (w *AtomicWriter) RemoveReplaced() error {
	var errs []error
	for _, v := range w.retired {
		errs = append(errs, w.removeVersion(v.version, dirHandles{}))
	}
	w.retired = nil
	return errors.Join(errs...)
}

// CollectDue returns when Collect will next remove a replaced version, or
// the zero time when none is kept.
func (w *AtomicWriter) CollectDue() time.Time {
	if len(w.retired) == 0 {
		return time.Time{}
	}
	return w.retired[0].at.Add(w.opts.Grace)
}

// removeVersion removes the version directory v, whose directories dirs
// holds open: each known file is unlinked relative to its directory's
// handle, then the directories, deepest first. Anything left over (a file
// added by hand) makes it fall back to removing the whole tree by path.
func (w *AtomicWriter) removeVersion(v *version, dirs dirHandles) error {
	if dirs["."] == nil {
		// Not held open by the caller: open it now.
		d, err := w.openVersion(v.name)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return w.removeAll(v.name)
		}
		dirs["."] = d
		defer dirs.close()
	}
	for _, p := range v.payload.Paths() {
		d := dirs.open(path.Dir(p))
		if d == nil {
			break
		}
		_ = unix.Unlinkat(int(d.Fd()), path.Base(p), 0)
	}
	clean := true
	for _, dir := range slices.Backward(slices.Sorted(maps.Keys(directories(v.payload)))) {
		parent := dirs.open(path.Dir(dir))
		if parent == nil || unix.Unlinkat(int(parent.Fd()), path.Base(dir), unix.AT_REMOVEDIR) != nil {
			clean = false
			break
		}
	}
	if clean && w.root.Remove(v.name) == nil {
		return nil
	}
	return w.removeAll(v.name)
}

// removeAll removes the version directory name and everything in it.
func (w *AtomicWriter) removeAll(name string) error {
	if err := w.root.RemoveAll(name); err != nil {
		return fmt.Errorf("atomic writer: remove previous version: %w", err)
	}
	return nil
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

// isRetired reports whether name is a replaced version kept for readers.
func (w *AtomicWriter) isRetired(name string) bool {
	for _, v := range w.retired {
		if v.name == name {
			return true
		}
	}
	return false
}

// sameDir checks that the mount directory's path still names the directory
// the writer holds open: removed or replaced by hand, the writer would
// otherwise write into a directory nobody sees.
func (w *AtomicWriter) sameDir() error {
	byPath, err := os.Lstat(w.dir)
	if err != nil {
		return fmt.Errorf("mount directory: %w", err)
	}
	held, err := w.root.Stat(".")
	if err != nil {
		return fmt.Errorf("mount directory: %w", err)
	}
	if !os.SameFile(byPath, held) {
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

// buildVersion writes payload into a new version directory and returns its
// name. Unchanged files are hard-linked from the current version, whose
// directories it opens into oldDirs.
//
// The directories of both versions are opened once, each relative to its
// parent without following symlinks, and every file is then created or
// linked relative to its directory's handle with a single-element name
// (CleanPath guarantees no "..", no "/" and no empty element). Each file
// thus costs one system call and no operation can leave the mount: os.Root
// would resolve the whole path again for every file, which on a 1,000-file
// mount costs more than the links themselves.
//
// It also returns the new directory's identity, which the switch checks.
func (w *AtomicWriter) buildVersion(payload Payload, oldDirs dirHandles) (name string, built os.FileInfo, err error) {
	name, err = w.mkVersionDir()
	if err != nil {
		return "", nil, err
	}
	newDirs := dirHandles{}
	defer func() {
		newDirs.close()
		if err != nil {
			_ = w.root.RemoveAll(name)
		}
	}()
	if newDirs["."], err = w.openVersion(name); err != nil {
		return "", nil, err
	}
	dirNames := slices.Sorted(maps.Keys(directories(payload))) // parents before children
	for _, dir := range dirNames {
		if newDirs[dir], err = w.mkdirAt(newDirs[path.Dir(dir)], path.Base(dir)); err != nil {
			return "", nil, err
		}
	}
	if w.current != nil {
		// A missing or replaced old version only means nothing is linked.
		oldDirs["."], _ = w.openVersion(w.current.name)
	}
	for _, p := range payload.Paths() {
		f := payload[p]
		dir, base := path.Dir(p), path.Base(p)
		if w.current != nil {
			if old, ok := w.current.payload[p]; ok && old.Equal(f) {
				if from := oldDirs.open(dir); from != nil && unix.Linkat(int(from.Fd()), base, int(newDirs[dir].Fd()), base, 0) == nil {
					continue
				}
				// The old file is gone (drift): write it instead.
			}
		}
		if err := w.writeFileAt(newDirs[dir], base, f); err != nil {
			return "", nil, err
		}
	}
	if w.opts.Sync {
		// Children first, so that each directory's entries are durable
		// before the entry that names the directory.
		for _, dir := range slices.Backward(dirNames) {
			if err := newDirs[dir].Sync(); err != nil {
				return "", nil, fmt.Errorf("atomic writer: fsync %s: %w", path.Join(name, dir), err)
			}
		}
		if err := newDirs["."].Sync(); err != nil {
			return "", nil, fmt.Errorf("atomic writer: fsync %s: %w", name, err)
		}
		if err := w.syncDir("."); err != nil {
			return "", nil, err
		}
	}
	if built, err = newDirs["."].Stat(); err != nil {
		return "", nil, fmt.Errorf("atomic writer: %w", err)
	}
	return name, built, nil
}

// dirHandles are open directories of one version, by path relative to the
// version ("." for the version itself).
type dirHandles map[string]*os.File

// open returns the handle of dir, opening it relative to its parent (without
// following symlinks) if needed; nil if it cannot be opened.
func (h dirHandles) open(dir string) *os.File {
	if d, ok := h[dir]; ok || dir == "." {
		return d
	}
	parent := h.open(path.Dir(dir))
	if parent == nil {
		return nil
	}
	fd, err := unix.Openat(int(parent.Fd()), path.Base(dir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	var d *os.File
	if err == nil {
		d = os.NewFile(uintptr(fd), dir)
	}
	h[dir] = d
	return d
}

func (h dirHandles) close() {
	for _, d := range h {
		if d != nil {
			d.Close()
		}
	}
}

// openVersion opens the version directory name, not following a symlink.
func (w *AtomicWriter) openVersion(name string) (*os.File, error) {
	d, err := w.root.OpenFile(name, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	return d, nil
}

// mkdirAt creates the directory base in parent with the writer's mode and
// owner, and returns it open.
func (w *AtomicWriter) mkdirAt(parent *os.File, base string) (*os.File, error) {
	if err := unix.Mkdirat(int(parent.Fd()), base, 0o700); err != nil {
		return nil, fmt.Errorf("atomic writer: mkdir %s: %w", base, err)
	}
	fd, err := unix.Openat(int(parent.Fd()), base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: open %s: %w", base, err)
	}
	d := os.NewFile(uintptr(fd), base)
	if err := w.chmodChownDir(d); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// chmodChownDir gives the open directory d the writer's mode and owner.
func (w *AtomicWriter) chmodChownDir(d *os.File) error {
	if err := d.Chmod(w.opts.DirMode.Perm()); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if w.opts.DirUID >= 0 || w.opts.DirGID >= 0 {
		if err := d.Chown(w.opts.DirUID, w.opts.DirGID); err != nil {
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	return nil
}

// mkVersionDir creates a new, empty version directory named
// ..<UTC time>.<random digits> and returns its name.
func (w *AtomicWriter) mkVersionDir() (string, error) {
	stamp := time.Now().UTC().Format(versionTimeLayout)
	for range 100 {
		n, err := rand.Int(rand.Reader, big.NewInt(1_000_000_000))
		if err != nil {
			return "", fmt.Errorf("atomic writer: %w", err)
		}
		name := fmt.Sprintf("..%s.%09d", stamp, n)
		err = w.mkdir(name)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		return name, err
	}
	return "", fmt.Errorf("atomic writer: %s: no free version directory name", w.dir)
}

// mkdir creates one directory with the writer's mode and owner.
func (w *AtomicWriter) mkdir(name string) error {
	if err := w.root.Mkdir(name, 0o700); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	d, err := w.root.Open(name)
	if err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	defer d.Close()
	return w.chmodChownDir(d)
}

// writeFileAt creates base in dir exclusively and without following a
// symlink, so that it never writes through one someone planted, and sets
// its mode and owner on the open file.
func (w *AtomicWriter) writeFileAt(dir *os.File, base string, f File) (err error) {
	fd, err := unix.Openat(int(dir.Fd()), base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("atomic writer: create %s: %w", base, err)
	}
	fh := os.NewFile(uintptr(fd), base)
	defer func() {
		if cerr := fh.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("atomic writer: %w", cerr)
		}
	}()
	if _, err := fh.Write(f.Data); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if err := fh.Chmod(f.Mode.Perm()); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if f.UID != w.uid || f.GID != w.gid {
		if err := fh.Chown(f.UID, f.GID); err != nil {
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	if w.opts.Sync {
		if err := fh.Sync(); err != nil {
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	return nil
}

// switchTo makes name, the directory built, the current version:
// ..data_tmp is pointed at it and renamed over ..data. It reports whether
// the switch happened; an error with switched true means the rename took
// place but fsync of the mount directory failed.
//
// Just before the rename, name must still be the directory built: one that
// vanished (or was replaced) is never switched to. Just after, it is checked
// again; if it vanished in between, ..data is pointed back at the previous
// version and ErrVersionVanished returned.
func (w *AtomicWriter) switchTo(name string, built os.FileInfo) (switched bool, err error) {
	if err := w.isBuilt(name, built); err != nil {
		return false, err
	}
	if err := w.pointData(name); err != nil {
		return false, err
	}
	if err := w.isBuilt(name, built); err != nil {
		if w.current != nil {
			_ = w.pointData(w.current.name)
		}
		return false, err
	}
	if w.opts.Sync {
		return true, w.syncDir(".")
	}
	return true, nil
}

// isBuilt checks that name still is the directory built.
func (w *AtomicWriter) isBuilt(name string, built os.FileInfo) error {
	info, err := w.root.Lstat(name)
	if err != nil || !os.SameFile(info, built) {
		return fmt.Errorf("atomic writer: %s: %w: %s (is another kvmount writing this mount?)", w.dir, ErrVersionVanished, name)
	}
	return nil
}

// pointData points ..data at name through ..data_tmp and a rename.
func (w *AtomicWriter) pointData(name string) error {
	if err := w.root.Remove(dataTmpName); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if err := w.root.Symlink(name, dataTmpName); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if w.opts.DirUID >= 0 || w.opts.DirGID >= 0 {
		if err := w.root.Lchown(dataTmpName, w.opts.DirUID, w.opts.DirGID); err != nil {
			_ = w.root.Remove(dataTmpName)
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	if testHookBeforeRename != nil {
		testHookBeforeRename(w.dir)
	}
	if err := w.root.Rename(dataTmpName, DataDirName); err != nil {
		_ = w.root.Remove(dataTmpName)
		return fmt.Errorf("atomic writer: %w", err)
	}
	return nil
}

// testHookBeforeRename, when set by a test, runs between creating
// ..data_tmp and renaming it over ..data.
var testHookBeforeRename func(dir string)

// addVisible creates a symlink name -> ..data/name for every first path
// element of payload that lacks one. When the visible entries are known it
// touches only new names; otherwise it checks every entry first, which also
// re-creates symlinks an interrupted kubelet-style write could lose
// (kubernetes#121472). An entry in the way that is not the writer's symlink
// is foreign content: it is left alone and reported.
func (w *AtomicWriter) addVisible(payload Payload) error {
	known := w.visible
	w.visible = nil // unknown until this update completes
	if known == nil {
		var err error
		if known, err = w.scanVisible(); err != nil {
			return err
		}
	}
	want := topLevel(payload)
	for _, name := range slices.Sorted(maps.Keys(want)) {
		if known[name] {
			continue
		}
		err := w.root.Symlink(path.Join(DataDirName, name), name)
		if errors.Is(err, fs.ErrExist) && !w.isVisibleLink(name) {
			return fmt.Errorf("atomic writer: %s: %w: %s is in the way of a visible symlink", w.dir, ErrForeignContent, name)
		}
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("atomic writer: %w", err)
		}
		if w.opts.DirUID >= 0 || w.opts.DirGID >= 0 {
			if err := w.root.Lchown(name, w.opts.DirUID, w.opts.DirGID); err != nil {
				return fmt.Errorf("atomic writer: %w", err)
			}
		}
		known[name] = true
	}
	w.visible = known
	return nil
}

// removeStaleVisible removes the writer's symlinks for first path elements
// no longer in payload, after the switch.
func (w *AtomicWriter) removeStaleVisible(payload Payload) error {
	want := topLevel(payload)
	known := w.visible
	w.visible = nil
	for name := range known {
		if !want[name] && w.isVisibleLink(name) {
			if err := w.root.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("atomic writer: %w", err)
			}
		}
	}
	w.visible = want
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

// syncDir fsyncs the directory name, making its entries durable.
func (w *AtomicWriter) syncDir(name string) error {
	d, err := w.root.Open(name)
	if err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	defer d.Close()
	if err := syncFile(d); err != nil {
		return fmt.Errorf("atomic writer: fsync %s: %w", name, err)
	}
	return nil
}

// syncFile fsyncs an open directory; a test replaces it to inject errors.
var syncFile = (*os.File).Sync

// cleanPayload validates every path of payload and returns it with cleaned
// paths. Two paths that clean to the same one, or a path that is both a file
// and the directory of another ("a" and "a/b"), are errors.
func cleanPayload(payload Payload) (Payload, error) {
	cleaned := payload
	for name := range payload {
		clean, err := CleanPath(name)
		if err != nil {
			return nil, fmt.Errorf("atomic writer: %w", err)
		}
		if clean != name {
			cleaned = nil
		}
	}
	if cleaned == nil {
		cleaned = make(Payload, len(payload))
		for name, f := range payload {
			clean, _ := CleanPath(name)
			if _, dup := cleaned[clean]; dup {
				return nil, fmt.Errorf("atomic writer: %w %q: another path cleans to %q too", ErrInvalidPath, name, clean)
			}
			cleaned[clean] = f
		}
	}
	return cleaned, checkConflicts(cleaned)
}

// checkConflicts rejects a payload in which one path is a file and also the
// directory of another, such as "a" and "a/b".
func checkConflicts(payload Payload) error {
	dirs := directories(payload)
	for name := range payload {
		if dirs[name] {
			return fmt.Errorf("atomic writer: %w %q: is both a file and a directory", ErrInvalidPath, name)
		}
	}
	return nil
}

// isVersionName reports whether name has the form of a version directory,
// ..2006_01_02_15_04_05.<suffix>.
func isVersionName(name string) bool {
	stampLen := len(versionTimeLayout)
	if len(name) < 2+stampLen+2 || !strings.HasPrefix(name, "..") || name[2+stampLen] != '.' {
		return false
	}
	_, err := time.Parse(versionTimeLayout, name[2:2+stampLen])
	return err == nil
}
