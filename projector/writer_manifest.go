package projector

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/untrusted"
)

// adoptManifest adopts the version name from its manifest: it reads and
// checks the manifest and compares it with the disk (matchesDisk). A
// missing or torn manifest is errNoManifest; one that differs from the
// disk, ErrDrift.
func (w *AtomicWriter) adoptManifest(name string) (*version, error) {
	m, err := w.readManifest(name)
	if err != nil {
		return nil, err
	}
	d, err := w.openVersion(name)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	if err := w.matchesDisk(m, d); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDrift, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(d.Fd()), &st); err != nil || !w.dirAttrsMatch(st) {
		w.rebuildDirs = true
	}
	return &version{name: name, manifest: m}, nil
}

// dropManifest removes the manifest of the version directory version, whose
// bytes were found to differ from what was written: a manifest never
// overrules bytes that were read, so the next adoption reads the version
// and the repair rewrites what differs.
func (w *AtomicWriter) dropManifest(version string) {
	if w.manifests != nil {
		_ = unix.Unlinkat(int(w.manifests.Fd()), manifestFile(version), 0)
	}
}

// checkManifest makes sure the current version, whose bytes were just
// found to match its payload, has a manifest that matches the disk and
// records that payload — so that the next start can adopt it without
// reading — and writes it anew if not (a manifest removed or edited by
// hand is not drift of the content readers see).
func (w *AtomicWriter) checkManifest() error {
	if w.manifests == nil {
		return nil
	}
	d, err := w.openVersion(w.current.name)
	if err != nil {
		return err
	}
	m, err := w.readManifest(w.current.name)
	if err == nil {
		err = w.matchesDisk(m, d)
	}
	d.Close()
	if err == nil && m.matchesPayload(w.current.payload) {
		return nil
	}
	return w.addManifest()
}

// addManifest writes the manifest of the current version, whose bytes are
// known (payload), into the manifest directory: under its name with
// manifestTmpSuffix, fsynced, then renamed over its name, and the directory
// fsynced. A crash in between leaves a temporary file that adoption
// removes. A manifest an older kvmount left inside the version directory
// is removed then. Without a manifest directory it does nothing.
func (w *AtomicWriter) addManifest() error {
	v := w.current
	if w.manifests == nil {
		return nil
	}
	d, err := w.openVersion(v.name)
	if err != nil {
		return err
	}
	defer d.Close()
	dirs := dirHandles{".": d}
	entries := make([]manifestEntry, 0, len(v.payload))
	for _, p := range v.payload.Paths() {
		e := entryOf(p, v.payload[p])
		sub := dirs.open(path.Dir(p))
		var st unix.Stat_t
		if sub == nil || unix.Fstatat(int(sub.Fd()), path.Base(p), &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			return fmt.Errorf("atomic writer: %s: %w: %s is missing", w.dir, ErrDrift, p)
		}
		e.Ino = st.Ino
		entries = append(entries, e)
	}
	delete(dirs, ".") // closed by the defer above
	defer dirs.close()
	mfd := int(w.manifests.Fd())
	name := manifestFile(v.name)
	tmp := name + manifestTmpSuffix
	if err := unix.Unlinkat(mfd, tmp, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if err := writeManifest(w.manifests, tmp, newManifest(entries), w.opts.Sync); err != nil {
		return err
	}
	if err := unix.Renameat(mfd, tmp, mfd, name); err != nil {
		return fmt.Errorf("atomic writer: %w", err)
	}
	if w.opts.Sync {
		if err := syncFile(w.manifests); err != nil {
			return fmt.Errorf("atomic writer: fsync %s: %w", w.manifests.Name(), err)
		}
	}
	// An older kvmount's manifest inside the version goes: the mount
	// holds payload files only.
	for _, legacy := range []string{legacyManifestName, legacyManifestTmpName} {
		if err := unix.Unlinkat(int(d.Fd()), legacy, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("atomic writer: remove %s of version %s: %w", legacy, v.name, err)
		}
	}
	v.noManifest = false
	return nil
}

// pruneManifests removes from the manifest directory every file that is
// not the manifest of a version in keep: manifests of versions removed
// meanwhile (a crash between a version's removal and its manifest's),
// temporary files of an interrupted addManifest.
func (w *AtomicWriter) pruneManifests(keep ...string) error {
	if w.manifests == nil {
		return nil
	}
	fd, err := unix.FcntlInt(w.manifests.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("atomic writer: manifests: %w", err)
	}
	d := os.NewFile(uintptr(fd), w.manifests.Name())
	defer d.Close()
	if _, err := d.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("atomic writer: manifests: %w", err)
	}
	names, err := d.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("atomic writer: manifests: %w", err)
	}
	for _, name := range names {
		if version, ok := versionOfManifest(name); ok && slices.Contains(keep, version) {
			continue
		}
		if err := unix.Unlinkat(fd, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("atomic writer: remove manifest %s: %w", name, err)
		}
	}
	return nil
}

// ForgetPayload drops what the writer holds in memory of the current
// version's files — its payload, or its manifest — and of the replaced
// versions kept for readers, keeping the current version's number of
// files (Files). The version's manifest on disk, written and fsynced
// before the switch to it, says the rest: the next Write or Verify reads
// it again (recall), one decode and no byte of the files. A monitor that
// holds no payload at rest calls it after each write, so that 1,000
// mounts of 100 keys are not held twice in memory, once by the worker
// that reads them and once here. It reports whether the writer forgot:
// not with no manifest directory (WriterOptions.ManifestDir), nor for a
// version without a manifest (written by an older kvmount) or none at
// all.
func (w *AtomicWriter) ForgetPayload() bool {
	v := w.current
	if v == nil || w.manifests == nil || v.noManifest {
		return false
	}
	if !v.forgotten {
		v.forget()
	}
	for _, r := range w.retired {
		if !r.noManifest && !r.forgotten {
			r.forget()
		}
	}
	return true
}

// recall reads again the manifest of a version the writer forgot
// (ForgetPayload), and reports whether it did. A manifest that cannot be
// read (removed by hand, torn) leaves v unknown: recall returns false, and
// a current version is then written anew by the next Write, which removes
// the rest as leftovers, as after drift.
func (w *AtomicWriter) recall(v *version) bool {
	if v == nil || !v.forgotten {
		return false
	}
	m, err := w.readManifest(v.name)
	if err != nil || len(m.Files) != v.count {
		return false
	}
	v.manifest, v.forgotten = m, false
	return true
}

// recallCurrent recalls the current version (recall), and forgets it as
// unknown when its manifest cannot be read. It reports whether the
// current version was recalled.
func (w *AtomicWriter) recallCurrent() bool {
	v := w.current
	if v == nil || !v.forgotten {
		return false
	}
	if !w.recall(v) {
		w.current = nil
		w.setVisible(nil)
		return false
	}
	return true
}

// sameBytes reports why disk, a version's files as read, is not what the
// manifest m records — a file missing, one whose bytes, size, mode or
// owner differ (by hash), one more — or nil when it is.
func (m *manifest) sameBytes(disk Payload) error {
	for _, e := range m.Files {
		got, ok := disk[e.Path]
		if !ok {
			return fmt.Errorf("%s is missing", untrusted.Escape(e.Path))
		}
		if !e.sameFile(got) {
			return fmt.Errorf("%s differs", untrusted.Escape(e.Path))
		}
	}
	if len(disk) != len(m.Files) {
		return fmt.Errorf("version holds %d files, want %d", len(disk), len(m.Files))
	}
	return nil
}
