package projector

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// A version's manifest: what its files are — paths, sizes, modes, owners,
// inode numbers and SHA-256 hashes — written and fsynced before the switch,
// like the files themselves. A restart adopts a version from its manifest
// with one fstat per file and compares the hashes with the desired payload,
// instead of reading every byte of every file (adoption costs O(files), not
// O(bytes)); the byte-for-byte comparison is left to the next verification
// (Verify). A version without a manifest, or with one that is torn or does
// not match the disk, is adopted by reading.
//
// Manifests live outside the mount, in a directory of the writer's own
// (WriterOptions.ManifestDir: kvmount's state_dir/manifests/<mount>), one
// file per version named after it: the mount holds the kubelet's layout
// and nothing else, so that a program that reads every entry under ..data
// meets only payload files, and no user who can write the mount can edit
// kvmount's bookkeeping. A manifest is fsynced, and its directory with it,
// before the switch to its version, so that power loss never leaves a
// switched version whose manifest is missing or torn; a manifest whose
// version is gone is removed with the leftovers. Manifests are readable by
// kvmount's user only (0600): the hash of a short secret would give it
// away.
//
// An earlier kvmount kept each manifest inside its version directory as
// ..manifest; such a version is adopted by reading, and the next write
// that finds it unchanged moves its manifest out (addManifest).

// Names of manifests.
const (
	// legacyManifestName and legacyManifestTmpName are where an older
	// kvmount kept a version's manifest: inside the version directory.
	legacyManifestName    = "..manifest"
	legacyManifestTmpName = "..manifest.tmp"
	// manifestTmpSuffix ends the name a manifest is written under when
	// added to an existing version (see addManifest).
	manifestTmpSuffix = ".tmp"
	// manifestFormat names the format; another is treated as missing.
	manifestFormat = "kvmount-manifest/1"
	// maxManifestSize bounds what is read of a manifest, in bytes.
	maxManifestSize = 64 << 20
)

// manifestFile returns the name of the manifest of the version directory
// version in a writer's manifest directory: the version's name without its
// leading "..".
func manifestFile(version string) string { return strings.TrimPrefix(version, "..") }

// versionOfManifest returns the version directory a file in a manifest
// directory describes, and false for a name that is no manifest's (a
// temporary file, anything else).
func versionOfManifest(file string) (string, bool) {
	version := ".." + file
	return version, isVersionName(version) && !strings.HasSuffix(file, manifestTmpSuffix)
}

// manifestEntry is one file of a version.
type manifestEntry struct {
	Path string `json:"path"`
	// Size in bytes; Mode the permission bits.
	Size int64  `json:"size"`
	Mode uint32 `json:"mode"`
	UID  int    `json:"uid"`
	GID  int    `json:"gid"`
	// Ino is the file's inode number on disk: a file replaced by another
	// (a rename over it) is told apart at once.
	Ino uint64 `json:"ino"`
	// SHA256 is the hash of the file's content, in hex.
	SHA256 string `json:"sha256"`
}

// manifest is a version's manifest: Files sorted by path, and Digest, the
// digest of the payload they make up (payloadDigest), first in the file so
// that PeekDigest reads only its head.
type manifest struct {
	Format string          `json:"format"`
	Digest string          `json:"digest"`
	Files  []manifestEntry `json:"files"`
	// index maps a path to its entry in Files.
	index map[string]int
}

// entryOf returns the manifest entry of f at path p, without its inode.
func entryOf(p string, f File) manifestEntry {
	e := entryWithoutHash(p, f)
	e.SHA256 = string(appendContentHash(nil, f.Data))
	return e
}

// entryWithoutHash returns the manifest entry of f at path p without its
// inode and its content hash, which the caller sets (setContentHashes).
func entryWithoutHash(p string, f File) manifestEntry {
	return manifestEntry{Path: p, Size: int64(len(f.Data)), Mode: uint32(f.Mode.Perm()), UID: f.UID, GID: f.GID}
}

// appendContentHash appends the hex SHA-256 of data to buf, as
// manifestEntry.SHA256 holds it: 2*sha256.Size bytes.
func appendContentHash(buf, data []byte) []byte {
	sum := sha256.Sum256(data)
	return hex.AppendEncode(buf, sum[:])
}

// setContentHashes sets each entry's content hash from hashes, where
// appendContentHash appended them in the order of entries, as substrings
// of one string: a version's entries take one allocation for their
// hashes, not two each. A write's garbage made per file is
// what spreads the objects that outlive a thousand mounts' first writes
// over the heap's spans (BENCHMARKS.md, "The monitor's heap after a cold
// start").
func setContentHashes(entries []manifestEntry, hashes []byte) {
	const n = 2 * sha256.Size
	all := string(hashes)
	for i := range entries {
		entries[i].SHA256 = all[i*n : (i+1)*n]
	}
}

// sameFile reports whether e records the file f (content by hash, size,
// mode and owner).
func (e manifestEntry) sameFile(f File) bool {
	if e.Size != int64(len(f.Data)) || e.Mode != uint32(f.Mode.Perm()) || e.UID != f.UID || e.GID != f.GID {
		return false
	}
	sum := sha256.Sum256(f.Data)
	var content [2 * sha256.Size]byte
	hex.Encode(content[:], sum[:])
	return string(content[:]) == e.SHA256
}

// payloadDigest returns the digest of a payload from its entries, sorted
// by path: SHA-256 over each entry's path, size, mode, owner and content
// hash (not its inode, which only the disk knows), in hex.
func payloadDigest(entries []manifestEntry) string {
	h := sha256.New()
	buf := make([]byte, 0, 256)
	for _, e := range entries {
		buf = appendDigestEntry(buf[:0], e.Path, e.Size, e.Mode, e.UID, e.GID, e.SHA256)
		h.Write(buf)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// appendDigestEntry appends to buf what payloadDigest hashes for one
// entry: its path, a NUL byte, its size, mode, owner and group as 8 bytes
// each (big-endian; a negative id as its two's complement), and the hex
// SHA-256 of its content, contentHex.
func appendDigestEntry[H string | []byte](buf []byte, path string, size int64, mode uint32, uid, gid int, contentHex H) []byte {
	buf = append(buf, path...)
	buf = append(buf, 0)
	for _, v := range [...]uint64{uint64(size), uint64(mode), uint64(int64(uid)), uint64(int64(gid))} {
		buf = binary.BigEndian.AppendUint64(buf, v)
	}
	return append(buf, contentHex...)
}

// Digest returns the digest of p that a version's manifest records
// (SHA-256, hex): equal digests mean the same paths with the same bytes,
// modes and owners. The reconciler compares it with PeekDigest to find
// the mounts whose content changed while kvmount was not running. It hashes
// every file's bytes once and allocates a few times per payload, not per
// file (BenchmarkPayloadDigest).
func (p Payload) Digest() string {
	h := sha256.New()
	buf := make([]byte, 0, 256)
	var content [2 * sha256.Size]byte
	for _, name := range p.Paths() {
		f := p[name]
		sum := sha256.Sum256(f.Data)
		hex.Encode(content[:], sum[:])
		buf = appendDigestEntry(buf[:0], name, int64(len(f.Data)), uint32(f.Mode.Perm()), f.UID, f.GID, content[:])
		h.Write(buf)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// PeekDigest returns the payload digest recorded in the manifest, kept in
// manifestDir, of the version that dir's ..data names, reading only the
// manifest's head, or false when there is none (nothing projected, a
// version without a manifest, anything unexpected). dir and manifestDir are
// opened without following a symlink in any component; nothing read is
// trusted beyond a hint — the adoption that follows checks everything
// again.
func PeekDigest(dir, manifestDir string) (string, bool) {
	d, err := fsutil.OpenDir(dir)
	if err != nil {
		return "", false
	}
	defer d.Close()
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(int(d.Fd()), DataDirName, buf)
	if err != nil || !isVersionName(string(buf[:n])) {
		return "", false
	}
	md, err := fsutil.OpenDir(manifestDir)
	if err != nil {
		return "", false
	}
	defer md.Close()
	f, err := openManifest(md, manifestFile(string(buf[:n])))
	if err != nil {
		return "", false
	}
	defer f.Close()
	head := fmt.Sprintf(`{"format":%q,"digest":"`, manifestFormat)
	want := make([]byte, len(head)+2*sha256.Size+1)
	if _, err := io.ReadFull(f, want); err != nil || !bytes.HasPrefix(want, []byte(head)) || want[len(want)-1] != '"' {
		return "", false
	}
	digest := string(want[len(head) : len(want)-1])
	if _, err := hex.DecodeString(digest); err != nil {
		return "", false
	}
	return digest, true
}

// openManifest opens the manifest name in the manifest directory dir for
// reading: without following a symlink, without blocking on a FIFO, and
// only if it is a regular file of kvmount's user within maxManifestSize
// bytes; anything else is an error wrapping errNoManifest.
func openManifest(dir *os.File, name string) (*os.File, error) {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNoManifest, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != os.Geteuid() || st.Size > maxManifestSize {
		unix.Close(fd)
		return nil, fmt.Errorf("%w: not a regular file of kvmount's user within %d bytes", errNoManifest, maxManifestSize)
	}
	return os.NewFile(uintptr(fd), name), nil
}

// writeManifest writes m into the manifest directory dir as name, readable
// by kvmount's user only, created exclusively without following a symlink,
// fsyncs it when sync is set, and closes it.
func writeManifest(dir *os.File, name string, m *manifest, sync bool) (err error) {
	fh, err := createManifest(dir, name, m)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := fh.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("atomic writer: %w", cerr)
		}
	}()
	if sync {
		if err := fh.Sync(); err != nil {
			return fmt.Errorf("atomic writer: %w", err)
		}
	}
	return nil
}

// createManifest writes m into the manifest directory dir as name, as
// writeManifest does, and returns the file open and not yet fsynced: the
// caller fsyncs it together with the version's files (syncBatch) and
// closes it. A file it created is closed, but not removed, on an error.
func createManifest(dir *os.File, name string, m *manifest) (*os.File, error) {
	data, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: manifest: %w", err)
	}
	data = append(data, '\n')
	if testHookManifest != nil {
		testHookManifest()
	}
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("atomic writer: create %s: %w", name, err)
	}
	fh := os.NewFile(uintptr(fd), name)
	if testHookManifestWrite != nil {
		// A crash test's kill lands between the halves.
		half := len(data) / 2
		if _, err := fh.Write(data[:half]); err != nil {
			fh.Close()
			return nil, fmt.Errorf("atomic writer: %w", err)
		}
		testHookManifestWrite()
		data = data[half:]
	}
	if _, err := fh.Write(data); err != nil {
		fh.Close()
		return nil, fmt.Errorf("atomic writer: %w", err)
	}
	return fh, nil
}

// Test hooks, set by tests and by crash-test binaries: testHookManifest
// runs before a manifest is created, testHookManifestWrite when half of
// it is written.
var testHookManifest, testHookManifestWrite func()

// errNoManifest means a version has no manifest kvmount can use: none
// (an older kvmount wrote it), torn, or of another format.
var errNoManifest = errors.New("no usable manifest")

// readManifest reads and checks the manifest of the version directory
// version from the writer's manifest directory: a regular file owned by
// kvmount's user, at most maxManifestSize bytes, of this format, whose
// entries are sorted, clean and unique and add up to its digest. Anything
// else — no manifest directory, no manifest — is errNoManifest.
func (w *AtomicWriter) readManifest(version string) (*manifest, error) {
	if w.manifests == nil {
		return nil, fmt.Errorf("%w: the writer keeps no manifests", errNoManifest)
	}
	f, err := openManifest(w.manifests, manifestFile(version))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxManifestSize+1))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNoManifest, err)
	}
	var m manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("%w: torn or not JSON", errNoManifest)
	}
	if m.Format != manifestFormat {
		return nil, fmt.Errorf("%w: another format", errNoManifest)
	}
	m.index = make(map[string]int, len(m.Files))
	for i, e := range m.Files {
		if clean, err := CleanPath(e.Path); err != nil || clean != e.Path || i > 0 && m.Files[i-1].Path >= e.Path {
			return nil, fmt.Errorf("%w: entries not clean, sorted and unique", errNoManifest)
		}
		m.index[e.Path] = i
	}
	if payloadDigest(m.Files) != m.Digest {
		return nil, fmt.Errorf("%w: its entries do not add up to its digest", errNoManifest)
	}
	return &m, nil
}

// matchesDisk compares m with the version directory dir: the same
// directories, each with the writer's mode and owner (DirMode, DirUID,
// DirGID), and the same regular files with the recorded size, mode, owner
// and inode — one fstat per entry, no byte read. It returns nil when they
// match, or an error saying how many entries differ (never echoing a name
// from the manifest or the directory, which a local user may control).
func (w *AtomicWriter) matchesDisk(m *manifest, dir *os.File) error {
	seen := 0
	differ := 0
	var walk func(d *os.File, rel string) error
	walk = func(d *os.File, rel string) error {
		names, err := d.Readdirnames(-1)
		if err != nil {
			return err
		}
		for _, name := range names {
			if rel == "" && strings.HasPrefix(name, "..") {
				continue // the manifest, or a stale ..manifest.tmp
			}
			p := path.Join(rel, name)
			var st unix.Stat_t
			if err := unix.Fstatat(int(d.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				return err
			}
			switch st.Mode & unix.S_IFMT {
			case unix.S_IFDIR:
				if !w.dirAttrsMatch(st) {
					differ++
					continue
				}
				fd, err := unix.Openat(int(d.Fd()), name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
				if err != nil {
					return err
				}
				sub := os.NewFile(uintptr(fd), p)
				err = walk(sub, p)
				sub.Close()
				if err != nil {
					return err
				}
			case unix.S_IFREG:
				i, ok := m.index[p]
				if !ok {
					differ++
					continue
				}
				seen++
				e := m.Files[i]
				if st.Size != e.Size || st.Mode&0o777 != e.Mode || int(st.Uid) != e.UID || int(st.Gid) != e.GID || st.Ino != e.Ino {
					differ++
				}
			default:
				differ++
			}
		}
		return nil
	}
	if err := walk(dir, ""); err != nil {
		return err
	}
	differ += len(m.Files) - seen
	if differ > 0 {
		return fmt.Errorf("%d of %d entries differ from the manifest", differ, len(m.Files))
	}
	return nil
}

// dirAttrsMatch reports whether a directory's stat has the writer's mode
// and owner.
func (w *AtomicWriter) dirAttrsMatch(st unix.Stat_t) bool {
	return fs.FileMode(st.Mode&0o777) == w.opts.DirMode.Perm() &&
		(w.opts.DirUID < 0 || int(st.Uid) == w.opts.DirUID) && (w.opts.DirGID < 0 || int(st.Gid) == w.opts.DirGID)
}

// matchesPayload reports whether m records exactly payload (by hash).
func (m *manifest) matchesPayload(payload Payload) bool {
	if len(m.Files) != len(payload) {
		return false
	}
	for _, e := range m.Files {
		f, ok := payload[e.Path]
		if !ok || !e.sameFile(f) {
			return false
		}
	}
	return true
}

// paths returns the manifest's paths, sorted.
func (m *manifest) paths() []string {
	out := make([]string, len(m.Files))
	for i, e := range m.Files {
		out[i] = e.Path
	}
	return out
}

// newManifest returns the manifest of entries, sorted by path.
func newManifest(entries []manifestEntry) *manifest {
	slices.SortFunc(entries, func(a, b manifestEntry) int { return strings.Compare(a.Path, b.Path) })
	return &manifest{Format: manifestFormat, Digest: payloadDigest(entries), Files: entries}
}
