package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
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
	// ErrNotKept is returned by Keep when the current version is not
	// known, from its manifest, to hold the payload of the digest asked:
	// the payload's bytes are needed to write it.
	ErrNotKept = errors.New("the version on disk is not known to hold that payload")
)

// DefaultGrace is how long kvmount keeps a replaced version after a switch
// unless configured otherwise (keep_replaced; WriterOptions.Grace).
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
	// Check, when set, is called with each new version, complete and
	// synced, before the switch. An error keeps the current version: Write
	// removes the new one and returns the error wrapped with
	// ErrCheckFailed. The version switched in afterwards is the very
	// directory the check saw: the switch refuses any other
	// (ErrVersionVanished). Until the check has ended the version's
	// directories are kvmount's and writable by it alone, whatever
	// DirUID and DirMode say, and it holds only regular files kvmount
	// created or verified (a file linked from the current version that is
	// no longer the one written is written anew): no user can make the
	// check read anything else, or wait on a FIFO.
	Check func(Candidate) error
	// CheckUID is the user Check's command runs as, -1 when unknown (see
	// candidateDirs).
	CheckUID int
	// Grace is how long a replaced version directory stays after a
	// switch, so that a reader that resolved ..data just before it can
	// still open its files (git-sync keeps its old worktree likewise). A
	// replaced version is removed by a later Write or by Collect once
	// Grace has passed — but at most MaxRetired replaced versions are
	// kept: under back-to-back writes the oldest goes first, whatever its
	// age; and a Write that finds the file system full removes them all.
	// Zero removes it at the end of the Write that replaced it, as the
	// kubelet does: a program that watches a file itself (inotify on the
	// path, which reaches the file inside the version) learns of the
	// change at once, and a reader that resolved ..data just before may
	// find its files gone. kvmount's default is DefaultGrace.
	Grace time.Duration
	// MaxFileSize and MaxFiles bound what reading a version back
	// (adoption without a manifest, verification) reads, in bytes per file
	// and in files: a version on disk beyond them is not read but
	// rewritten. Zero means no bound; kvmount sets the mount's
	// max_value_size and max_files.
	MaxFileSize int64
	MaxFiles    int
	// ManifestDir is the directory, outside the mount, where the writer
	// keeps its versions' manifests (see manifest.go): one it alone uses,
	// reached without a symlink in any component. "" keeps none: every
	// adoption then reads every file.
	ManifestDir string
}

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
//     the open file; hard-link unchanged files from the current version.
//     When Sync is set, fsync the new files, the new directories, the
//     manifest and the mount directory, together (syncBatch).
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
	dir  string
	root *os.Root
	// ident identifies the directory root holds; dev and ino are its
	// st_dev and st_ino in this boot, which the path must still reach
	// (sameDir).
	ident    fsutil.Ident
	dev, ino uint64
	// defaultACL: the directory had a default ACL, or might have, when
	// the writer opened it; owned: at the last sameDir, it was the
	// writer's own user's (versionsMayInherit).
	defaultACL, owned bool
	// mount is a plain handle on the directory root holds, for the *at
	// system calls of removals (never read from: it shares its offset).
	mount *os.File
	// manifests is the manifest directory (WriterOptions.ManifestDir)
	// held open, nil without one.
	manifests *os.File
	opts      WriterOptions
	adopted   bool
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
	// or nil when unknown (after drift), which makes the next write check
	// every entry of the mount directory — unless visibleOf is set: then
	// they are the first path elements of that version's files, and no
	// set is kept (a mount at rest would otherwise hold a copy of its
	// names: 4 MB of heap at 1,000 mounts of 100 files). Set both with
	// setVisible, read them with knownVisible.
	visible   map[string]bool
	visibleOf *version
	// left holds the entries of the mount directory that were to be
	// removed but that the rights of removals could not remove (see
	// removeTree), and leftErr why: they stay, and verification does not
	// take them for drift it could repair.
	left    map[string]bool
	leftErr error
	uid     int
	gid     int
}

// setVisible records known as the first path elements known to have their
// symlink (nil: unknown). When they are the current version's, only that
// is kept.
func (w *AtomicWriter) setVisible(known map[string]bool) {
	w.visible, w.visibleOf = known, nil
	if known != nil && w.current != nil && maps.Equal(known, w.current.topLevel()) {
		w.visible, w.visibleOf = nil, w.current
	}
}

// knownVisible returns the first path elements known to have their
// symlink, nil when unknown. The caller may change the map it returns.
func (w *AtomicWriter) knownVisible() map[string]bool {
	if w.visibleOf != nil {
		return w.visibleOf.topLevel()
	}
	return w.visible
}

// OpenAtomicWriter returns a writer for the existing directory dir. It reads
// nothing yet; Adopt or the first Write inspects the directory. The writer
// holds dir open until Close.
//
// dir is opened without following a symlink in any component
// (fsutil.OpenDir): a mount directory replaced by a symlink is refused with
// an error wrapping fsutil.ErrNotDir (fsutil.ErrSymlink for a symlink in a
// parent), and nothing behind the symlink is read or touched.
func OpenAtomicWriter(dir string, opts WriterOptions) (*AtomicWriter, error) {
	d, err := fsutil.OpenDir(dir)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	defer d.Close()
	return OpenAtomicWriterAt(dir, d, opts)
}

// OpenAtomicWriterAt returns a writer for the directory d holds open, whose
// path is dir (for errors, and to find out later whether the path still
// reaches it). d stays the caller's to close; the writer opens its own
// handle on the same directory, and on opts.ManifestDir, which must exist.
func OpenAtomicWriterAt(dir string, d *os.File, opts WriterOptions) (*AtomicWriter, error) {
	ident, err := fsutil.IdentOf(d)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(d.Fd()), &st); err != nil {
		return nil, fmt.Errorf("atomic writer: %w", &fs.PathError{Op: "fstat", Path: dir, Err: err})
	}
	root, err := os.OpenRoot(fsutil.ProcPath(d))
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	if opts.DirMode == 0 {
		opts.DirMode = 0o755
	}
	opts.Grace = max(opts.Grace, 0)
	fd, err := unix.FcntlInt(d.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		root.Close()
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	w := &AtomicWriter{dir: dir, root: root, mount: os.NewFile(uintptr(fd), dir), ident: ident, dev: st.Dev, ino: st.Ino,
		defaultACL: fsutil.MayHaveDefaultACL(d), opts: opts, uid: os.Geteuid(), gid: os.Getegid()}
	if opts.ManifestDir != "" {
		if w.manifests, err = fsutil.OpenDir(opts.ManifestDir); err != nil {
			root.Close()
			w.mount.Close()
			return nil, fmt.Errorf("atomic writer: manifests: %w", err)
		}
	}
	return w, nil
}

// Candidate is a new version that a Check may refuse before the switch.
type Candidate struct {
	// MountDir is the mount directory's path, and Version the name of the
	// new version directory in it.
	MountDir, Version string
	// Mount identifies the directory the writer writes into (a tmpfs
	// mount's root), and VersionIdent the new version directory: a check
	// that reaches them by path can make sure that it sees them, and not
	// what someone who can write one of MountDir's parents put there.
	Mount, VersionIdent fsutil.Ident
}

// Path returns the new version directory's path.
func (c Candidate) Path() string { return filepath.Join(c.MountDir, c.Version) }

// SetCheck replaces WriterOptions.Check, and CheckUID, for the following
// writes.
func (w *AtomicWriter) SetCheck(check func(Candidate) error, uid int) {
	w.opts.Check, w.opts.CheckUID = check, uid
}

// Files returns how many files the current version holds: 0 when the
// mount is empty or its content is unknown.
func (w *AtomicWriter) Files() int {
	if w.current == nil {
		return 0
	}
	return w.current.files()
}

// Digest returns the digest of the current version's payload
// (Payload.Digest, in hex) as its manifest records it, without hashing
// anything again; "" when the writer does not know it (no version, or
// none written or adopted with a manifest).
func (w *AtomicWriter) Digest() string {
	if w.current == nil {
		return ""
	}
	if w.current.manifest != nil {
		return w.current.manifest.Digest
	}
	return w.current.digest
}

// Version returns the name of the current version directory, or "" when none
// is known.
func (w *AtomicWriter) Version() string {
	if w.current == nil {
		return ""
	}
	return w.current.name
}

// Close releases the mount directory and the manifest directory.
func (w *AtomicWriter) Close() error {
	if w.manifests != nil {
		w.manifests.Close()
	}
	w.mount.Close()
	return w.root.Close()
}

// Write projects payload into the mount directory (see AtomicWriter for the
// steps) and returns what changed. Nothing is written when data, modes and
// owners are unchanged. On error the previous version stays in place and
// visible; a partly built version directory is removed. A mount directory
// whose path no longer reaches the directory the writer holds — renamed
// away by the owner of a parent, a symlink put in its place — is not
// written: Write returns an error wrapping fsutil.ErrReplaced, and the
// writer is to be closed (Medium.Prepare decides about what is there now).
func (w *AtomicWriter) Write(payload Payload) (Change, error) {
	payload, err := cleanPayload(payload)
	if err != nil {
		return Change{}, err
	}
	if err := w.sameDir(); err != nil {
		return Change{}, fmt.Errorf("atomic writer: %s: %w: %v", w.dir, fsutil.ErrReplaced, err)
	}
	if !w.adopted {
		if _, err := w.Adopt(); err != nil {
			return Change{}, err
		}
	}
	w.recallCurrent()
	change := Diff(nil, payload)
	if w.current != nil {
		if w.current.holds(payload) && !w.rebuildDirs {
			// Known by its bytes from here on.
			if w.current.manifest != nil {
				w.current.digest = w.current.manifest.Digest
			}
			w.current.payload, w.current.manifest = payload, nil
			if w.current.noManifest {
				if err := w.addManifest(); err != nil {
					return Change{}, err
				}
			}
			want := topLevel(payload)
			if err := w.addVisible(want); err != nil {
				return Change{}, err
			}
			return Change{}, w.removeStaleVisible(want)
		}
		change = w.current.diff(payload)
	}
	oldDirs := dirHandles{}
	defer oldDirs.close()
	var name string
	var built builtVersion
	err = w.makingRoom(func() (err error) {
		name, built, err = w.buildVersion(payload, oldDirs)
		return err
	})
	if err != nil {
		return Change{}, err
	}
	if w.opts.Check != nil {
		if err := w.opts.Check(Candidate{MountDir: w.dir, Version: name, Mount: w.ident, VersionIdent: built.ident}); err != nil {
			_ = w.removeTree(w.mount, name, true)
			return Change{}, fmt.Errorf("atomic writer: %w: %w", ErrCheckFailed, err)
		}
		if w.candidateDirs() {
			if err := w.handOver(name, built.dirs); err != nil {
				_ = w.removeTree(w.mount, name, true)
				return Change{}, err
			}
		}
	}
	// New visible names dangle until the switch, then resolve: a crash at
	// any point leaves every name of the current version visible.
	want := topLevel(payload)
	if err := w.makingRoom(func() error { return w.addVisible(want) }); err != nil {
		_ = w.removeTree(w.mount, name, true)
		return Change{}, err
	}
	var switched bool
	var syncErr error // of a switch that happened
	err = w.makingRoom(func() error {
		var err error
		if switched, err = w.switchTo(name, built); switched {
			syncErr = err
			return nil
		}
		return err
	})
	if !switched {
		_ = w.removeTree(w.mount, name, true)
		return Change{}, err
	}
	err = syncErr
	previous := w.current
	w.current = &version{name: name, payload: payload, digest: built.digest}
	w.rebuildDirs = false
	if err != nil {
		// Switched, but not durable (fsync failed): the new version is
		// what readers see, so it stays; the caller retries.
		w.retire(previous, oldDirs)
		return change, err
	}
	if err := w.removeStaleVisible(want); err != nil {
		return change, err
	}
	if previous == nil {
		// Unknown leftovers (after drift or on the first write): scan.
		w.retired = nil
		return change, w.removeLeftovers(name)
	}
	return change, w.retire(previous, oldDirs)
}

// makingRoom runs step; when it finds the file system full (ENOSPC: out of
// space, or of inodes on a tmpfs with nr_inodes) while replaced versions
// are kept for readers, they give way and step is tried once more.
func (w *AtomicWriter) makingRoom(step func() error) error {
	err := step()
	if errors.Is(err, syscall.ENOSPC) && len(w.retired) > 0 {
		if rerr := w.RemoveReplaced(); rerr != nil {
			return rerr
		}
		err = step()
	}
	return err
}

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

// isVersionName reports whether name has exactly the form of a version
// directory kvmount makes, ..2006_01_02_15_04_05.<nine digits>: nothing
// else found in a mount is adopted as a version, and so no name a user
// chose (with control characters in it, say) is ever taken for one.
func isVersionName(name string) bool {
	stampLen := len(versionTimeLayout)
	if len(name) != 2+stampLen+1+versionSuffixLen || !strings.HasPrefix(name, "..") || name[2+stampLen] != '.' {
		return false
	}
	for _, c := range name[2+stampLen+1:] {
		if c < '0' || c > '9' {
			return false
		}
	}
	_, err := time.Parse(versionTimeLayout, name[2:2+stampLen])
	return err == nil
}

// versionSuffixLen is the length of a version directory's random suffix,
// in decimal digits.
const versionSuffixLen = 9
