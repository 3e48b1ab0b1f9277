package projector

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// Building a version directory through directory handles, and the visible
// symlinks of the layout.

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
// It also returns the new directory's identity, which the check and the
// switch use.
func (w *AtomicWriter) buildVersion(payload Payload, oldDirs dirHandles) (name string, built builtVersion, err error) {
	name, top, err := w.mkVersionDir()
	if err != nil {
		return "", builtVersion{}, err
	}
	newDirs := dirHandles{".": top}
	partial := name // the returns below clear name
	defer func() {
		newDirs.close()
		if err != nil {
			_ = w.removeTree(w.mount, partial, true)
		}
	}()
	dirNames := slices.Sorted(maps.Keys(directories(payload))) // parents before children
	for _, dir := range dirNames {
		if newDirs[dir], err = w.mkdirAt(newDirs[path.Dir(dir)], path.Base(dir)); err != nil {
			return "", builtVersion{}, err
		}
	}
	syncs := &syncBatch{}
	defer syncs.discard() // after an error: close what is still open
	// The manifest's entries, with each file's hash and inode: for a
	// writer that keeps none (a tmpfs mount), neither a hash nor an
	// fstat(2) of a file written is needed.
	var entries []manifestEntry
	var hashes []byte
	if w.manifests != nil {
		entries = make([]manifestEntry, 0, len(payload))
		hashes = make([]byte, 0, len(payload)*2*sha256.Size)
	}
	for _, p := range payload.Paths() {
		f := payload[p]
		dir, base := path.Dir(p), path.Base(p)
		entry := entryWithoutHash(p, f)
		if w.manifests != nil {
			hashes = appendContentHash(hashes, f.Data)
		}
		linked := false
		if w.current != nil && w.current.has(p, f) {
			if _, tried := oldDirs["."]; !tried {
				// Opened for the first file to link, not for a payload
				// whose every file changed. A missing or replaced old
				// version only means nothing is linked.
				oldDirs["."], _ = w.openVersion(w.current.name)
			}
			if from := oldDirs.open(dir); from != nil && unix.Linkat(int(from.Fd()), base, int(newDirs[dir].Fd()), base, 0) == nil {
				var st unix.Stat_t
				if err := unix.Fstatat(int(newDirs[dir].Fd()), base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
					return "", builtVersion{}, fmt.Errorf("atomic writer: %w", err)
				}
				if w.current.linkable(p, f, &st) {
					entry.Ino, linked = st.Ino, true
				} else if err := unix.Unlinkat(int(newDirs[dir].Fd()), base, 0); err != nil {
					return "", builtVersion{}, fmt.Errorf("atomic writer: %w", err)
				}
			}
			// Else the old file is gone or is not the one written (drift,
			// or a user's swap): write it instead.
		}
		if !linked {
			if entry.Ino, err = w.writeFileAt(newDirs[dir], base, f, syncs, w.manifests != nil); err != nil {
				return "", builtVersion{}, err
			}
		}
		if w.manifests != nil {
			entries = append(entries, entry)
		}
	}
	setContentHashes(entries, hashes)
	if w.manifests != nil {
		mname := manifestFile(name)
		// A leftover of the same name (of a version removed by hand).
		_ = unix.Unlinkat(int(w.manifests.Fd()), mname, 0)
		m := newManifest(entries)
		built.digest = m.Digest
		mf, merr := createManifest(w.manifests, mname, m)
		if merr != nil {
			_ = unix.Unlinkat(int(w.manifests.Fd()), mname, 0)
			return "", builtVersion{}, merr
		}
		defer func() {
			if err != nil {
				_ = unix.Unlinkat(int(w.manifests.Fd()), mname, 0)
			}
		}()
		if w.opts.Sync {
			// Durable, file and entry, before the switch to its version.
			if err := syncs.add(mf); err != nil {
				return "", builtVersion{}, err
			}
			if err := syncs.addDir(w.manifests, w.manifests.Name()); err != nil {
				return "", builtVersion{}, err
			}
		} else if err := mf.Close(); err != nil {
			return "", builtVersion{}, fmt.Errorf("atomic writer: %w", err)
		}
	}
	if w.opts.Sync {
		// The new directories and the mount directory's entry of the
		// version, fsynced with the files: every one is durable before
		// the switch, and nothing names the version until then, so their
		// order among themselves does not matter (a crash before the
		// switch leaves a version that the next start removes).
		for _, dir := range dirNames {
			if err := syncs.addDir(newDirs[dir], path.Join(name, dir)); err != nil {
				return "", builtVersion{}, err
			}
		}
		if err := syncs.addDir(newDirs["."], name); err != nil {
			return "", builtVersion{}, err
		}
		if err := syncs.addDir(w.mount, w.dir); err != nil {
			return "", builtVersion{}, err
		}
	}
	if err := syncs.flush(); err != nil {
		return "", builtVersion{}, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(newDirs["."].Fd()), &st); err != nil {
		return "", builtVersion{}, fmt.Errorf("atomic writer: %w", &fs.PathError{Op: "fstat", Path: name, Err: err})
	}
	// Made by mkdirat in the mount directory, the version is on its file
	// system: its identity is the mount's file system and its own inode,
	// what fsutil.IdentOf would find with two more system calls.
	built.dev, built.ident = st.Dev, fsutil.Ident{FS: w.ident.FS, Ino: st.Ino}
	built.dirs = dirNames
	return name, built, nil
}

// builtVersion identifies a version directory just built.
type builtVersion struct {
	// dev is the st_dev of the version directory (stat(2)): what, with
	// ident's inode, the switch checks the name still reaches.
	dev   uint64
	ident fsutil.Ident
	// dirs are the directories inside it, parents first.
	dirs []string
	// digest is its payload's digest (Payload.Digest), from its
	// manifest; "" without a manifest directory.
	digest string
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
	fd, err := openEntryDir(parent, path.Base(dir))
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

// openVersion opens the version directory name, an entry of the mount
// directory, relative to the writer's handle on it and not following a
// symlink. The error wraps fs.ErrNotExist when there is no such entry.
//
// It is one openat(2) and an fcntl(2): os.Root.OpenFile would also try to
// register the directory with the runtime's poller and take that back, four
// more system calls, three times on each write's path (BenchmarkWriteOneKey).
func (w *AtomicWriter) openVersion(name string) (*os.File, error) {
	fd, err := openEntryDir(w.mount, name)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	return os.NewFile(uintptr(fd), name), nil
}

// openEntryDir opens name, a single entry of the directory parent (no
// "/", not "." or ".."), as a directory without following a symlink, and
// returns the raw descriptor. A symlink gives ELOOP or ENOTDIR.
func openEntryDir(parent *os.File, name string) (int, error) {
	if name == "" || name == "." || name == ".." || strings.ContainsRune(name, '/') {
		return -1, &fs.PathError{Op: "openat", Path: name, Err: fs.ErrInvalid}
	}
	fd, err := unix.Openat(int(parent.Fd()), name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, &fs.PathError{Op: "openat", Path: name, Err: err}
	}
	return fd, nil
}

// linkable reports whether st, a file just linked from v into a new
// version at path p, is v's file f: a regular file with f's owner, mode
// and size (and, when v is known from its manifest, the inode recorded).
// The link lands in a directory only root can change (candidateDirs), so
// what st says stays true; a symlink, FIFO, device or another file that
// a user who can write v's directories put in its place is not linked but
// written anew — never followed, opened or handed to a check.
func (v *version) linkable(p string, f File, st *unix.Stat_t) bool {
	if st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != f.UID || int(st.Gid) != f.GID ||
		fs.FileMode(st.Mode).Perm() != f.Mode.Perm() || st.Size != int64(len(f.Data)) {
		return false
	}
	if v.payload == nil && v.manifest != nil {
		i, ok := v.manifest.index[p]
		return ok && v.manifest.Files[i].Ino == st.Ino
	}
	return true
}

// mkdirAt creates the directory base in parent with the writer's mode and
// owner — while a check is to see the version, root's (candidateDirs) —
// and returns it open.
func (w *AtomicWriter) mkdirAt(parent *os.File, base string) (*os.File, error) {
	if err := unix.Mkdirat(int(parent.Fd()), base, 0o700); err != nil {
		return nil, fmt.Errorf("atomic writer: mkdir %s: %w", base, err)
	}
	fd, err := openEntryDir(parent, base)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	d := os.NewFile(uintptr(fd), base)
	if err := w.chmodChownDir(d); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// chmodChownDir gives the open directory d of a version being built the
// writer's mode and owner; while the version is a candidate that someone
// else could otherwise change before its check ends (candidateDirs), the
// owner is kvmount's user and the mode lacks group and other write.
func (w *AtomicWriter) chmodChownDir(d *os.File) error {
	mode, uid := w.opts.DirMode.Perm(), w.opts.DirUID
	if w.candidateDirs() {
		mode, uid = mode&^0o022, -1
	}
	if err := d.Chmod(mode); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if uid >= 0 || w.opts.DirGID >= 0 {
		if err := d.Chown(uid, w.opts.DirGID); err != nil {
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	return nil
}

// candidateDirs reports whether a new version's directories are built as
// kvmount's own, not writable by group or others, and handed to their
// configured owner and mode only once its check has ended (handOver): with
// a Check, when the directories belong to another user or others may
// write them. Until then no user but root can add, remove or swap an entry
// of the candidate, so that the check — which may run as another user
// than the one who owns the mount, root included — reads exactly the
// regular files kvmount put there.
//
// Not when the check runs as the user who owns the directories
// (WriterOptions.CheckUID): that user can change only what their own check
// sees, and could change the files after the switch anyway.
func (w *AtomicWriter) candidateDirs() bool {
	othersOwn := w.opts.DirUID >= 0 && w.opts.DirUID != w.uid && w.opts.DirUID != w.opts.CheckUID
	return w.opts.Check != nil && (othersOwn || w.opts.DirMode.Perm()&0o022 != 0)
}

// handOver gives the directories of the checked version name their
// configured owner and mode (see candidateDirs); dirs are their paths
// relative to the version.
func (w *AtomicWriter) handOver(name string, dirs []string) error {
	d, err := w.openVersion(name)
	if err != nil {
		return err
	}
	h := dirHandles{".": d}
	defer h.close()
	for _, dir := range append([]string{"."}, dirs...) {
		sub := h.open(dir)
		if sub == nil {
			return fmt.Errorf("atomic writer: %s: %w: %s/%s", w.dir, ErrVersionVanished, name, dir)
		}
		if err := sub.Chmod(w.opts.DirMode.Perm()); err != nil {
			return fmt.Errorf("atomic writer: %w", err)
		}
		if err := sub.Chown(w.opts.DirUID, w.opts.DirGID); err != nil {
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	return nil
}

// mkVersionDir creates a new, empty version directory named
// ..<UTC time>.<random digits> and returns its name and the directory,
// open.
func (w *AtomicWriter) mkVersionDir() (string, *os.File, error) {
	stamp := time.Now().UTC().AppendFormat(append(make([]byte, 0, versionNameLen), ".."...), versionTimeLayout)
	for range 100 {
		name := versionName(stamp)
		d, err := w.mkdir(name)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		return name, d, err
	}
	return "", nil, fmt.Errorf("atomic writer: %s: no free version directory name", w.dir)
}

// versionNameLen is the length of a version directory's name: "..", the
// timestamp, "." and its random suffix.
const versionNameLen = 2 + len(versionTimeLayout) + 1 + versionSuffixLen

// versionName returns stamp ("..<UTC time>") followed by "." and
// versionSuffixLen random decimal digits from crypto/rand, so that a name
// is not known before it is made. (crypto/rand.Read does not fail: Go
// 1.24 and later crash the program instead.) The modulo's bias is of no
// concern: the digits only make a name unlikely to be taken.
func versionName(stamp []byte) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	// At most versionSuffixLen digits; the name is appended into stamp's
	// spare capacity, which leaves stamp as it is.
	n := binary.LittleEndian.Uint64(b[:]) % 1_000_000_000
	name := append(stamp, '.')
	digits := strconv.AppendUint(nil, n, 10)
	for range versionSuffixLen - len(digits) {
		name = append(name, '0')
	}
	return string(append(name, digits...))
}

// mkdir creates one version directory with the writer's mode and owner,
// and without the POSIX ACL that a default ACL on the mount directory would
// give it: what is created in it then inherits none either, so every file
// and directory of a version carries exactly its owner and mode. It
// returns the directory open; after an error nothing of it is left.
func (w *AtomicWriter) mkdir(name string) (*os.File, error) {
	if err := unix.Mkdirat(int(w.mount.Fd()), name, 0o700); err != nil {
		return nil, fmt.Errorf("atomic writer: %w", &fs.PathError{Op: "mkdirat", Path: name, Err: err})
	}
	d, err := w.openVersion(name)
	if err == nil {
		if err = w.stripInherited(d); err == nil {
			if err = w.chmodChownDir(d); err == nil {
				return d, nil
			}
		}
		d.Close()
	}
	// It goes now, rather than at the next start's removal of leftovers,
	// with the rights removals in the mount take (removeTree).
	_ = w.removeTree(w.mount, name, true)
	return nil, err
}

// stripInherited removes the ACLs the new version directory d may have
// inherited from the mount directory (versionsMayInherit).
func (w *AtomicWriter) stripInherited(d *os.File) error {
	if !w.versionsMayInherit() {
		return nil
	}
	if err := fsutil.StripACL(d); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	return nil
}

// writeFileAt creates base in dir exclusively and without following a
// symlink, so that it never writes through one someone planted, sets its
// mode and owner on the open file, and returns its inode number (for the
// manifest) when withIno is set, else 0 without an fstat(2). With
// WriterOptions.Sync the file is handed to syncs, which fsyncs and closes
// it; else it is closed here.
func (w *AtomicWriter) writeFileAt(dir *os.File, base string, f File, syncs *syncBatch, withIno bool) (ino uint64, err error) {
	// A descriptor, not an *os.File: a file of a version is written once
	// and closed, and an *os.File is two objects and a cleanup for the
	// runtime to run, for each of a cold start's 100,000 files.
	fd, err := unix.Openat(int(dir.Fd()), base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return 0, fmt.Errorf("atomic writer: create %s: %w", base, err)
	}
	handed := false
	defer func() {
		if handed {
			return
		}
		if cerr := unix.Close(fd); cerr != nil && err == nil {
			err = fmt.Errorf("atomic writer: close %s: %w", base, cerr)
		}
	}()
	if err := writeAll(fd, f.Data); err != nil {
		return 0, fmt.Errorf("atomic writer: write %s: %w", base, err)
	}
	if err := unix.Fchmod(fd, uint32(f.Mode.Perm())); err != nil {
		return 0, fmt.Errorf("atomic writer: chmod %s: %w", base, err)
	}
	if f.UID != w.uid || f.GID != w.gid {
		if err := unix.Fchown(fd, f.UID, f.GID); err != nil {
			return 0, fmt.Errorf("atomic writer: chown %s: %w", base, err)
		}
	}
	if withIno {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return 0, fmt.Errorf("atomic writer: %w", err)
		}
		ino = st.Ino
	}
	if w.opts.Sync {
		handed = true
		return ino, syncs.addFd(fd, base)
	}
	return ino, nil
}

// writeAll writes data to the file fd, retrying a write that the kernel
// cut short or a signal interrupted, as os.File.Write does.
func writeAll(fd int, data []byte) error {
	for len(data) > 0 {
		n, err := unix.Write(fd, data)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrShortWrite
		}
		data = data[n:]
	}
	return nil
}

// addVisible creates a symlink name -> ..data/name for every name of want
// (the first path elements of a payload, topLevel) that lacks one. When the visible entries are known it
// touches only new names; otherwise it checks every entry first, which also
// re-creates symlinks an interrupted kubelet-style write could lose
// (kubernetes#121472). An entry in the way that is not the writer's symlink
// is foreign content: it is left alone and reported.
func (w *AtomicWriter) addVisible(want map[string]bool) error {
	known := w.knownVisible()
	w.setVisible(nil) // unknown until this update completes
	if known == nil {
		var err error
		if known, err = w.scanVisible(); err != nil {
			return err
		}
	}
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
	w.setVisible(known)
	return nil
}

// removeStaleVisible removes the writer's symlinks for first path elements
// not in want (those of the payload the current version holds, topLevel),
// after the switch to that version.
func (w *AtomicWriter) removeStaleVisible(want map[string]bool) error {
	known := w.knownVisible()
	w.setVisible(nil)
	for name := range known {
		if !want[name] && w.isVisibleLink(name) {
			if err := w.root.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("atomic writer: %w", err)
			}
		}
	}
	// Exactly the current version's names now: nothing to keep.
	w.visible, w.visibleOf = nil, w.current
	return nil
}
