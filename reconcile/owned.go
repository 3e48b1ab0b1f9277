package reconcile

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/projector"
)

// ownedFile is the name of the record of owned mounts in the state
// directory, and manifestsDir the directory in it that holds, for each
// mount, the manifests of its versions (projector.WriterOptions.ManifestDir).
const (
	ownedFile    = "mounts.json"
	manifestsDir = "manifests"
)

// Record is what kvmount remembers of a mount it owns.
type Record struct {
	// Dir is the mount directory.
	Dir string `json:"dir"`
	// Medium is the medium the mount lives on.
	Medium string `json:"medium"`
	// CreatedDir reports that kvmount created Dir and removes it on
	// teardown.
	CreatedDir bool `json:"created_dir"`
	// Ident identifies Dir on its parent's file system (for a tmpfs
	// mount, the directory the tmpfs is mounted on), and TmpfsIdent the
	// root of kvmount's tmpfs there: a path that reaches another
	// directory is refused, never taken over. Nil in a record written
	// before kvmount recorded them: the next setup records what it finds.
	Ident      *fsutil.Ident `json:"ident,omitempty"`
	TmpfsIdent *fsutil.Ident `json:"tmpfs_ident,omitempty"`
	// Marker is the token of the marker kvmount gives Dir and its tmpfs's
	// root (fsutil.MarkerAttr): how it recognises them after a remount or
	// reboot that renumbered their file system. "" where the file system
	// keeps no marker, and in a record written before kvmount set them.
	Marker string `json:"marker,omitempty"`
}

// owner returns what r records to recognise the mount directory.
func (r Record) owner() projector.Owner {
	return projector.Owner{Dir: r.Ident, Tmpfs: r.TmpfsIdent, Marker: r.Marker}
}

// same reports whether r and q record the same thing.
func (r Record) same(q Record) bool {
	return r.Dir == q.Dir && r.Medium == q.Medium && r.CreatedDir == q.CreatedDir && r.Marker == q.Marker &&
		sameIdent(r.Ident, q.Ident) && sameIdent(r.TmpfsIdent, q.TmpfsIdent)
}

func sameIdent(a, b *fsutil.Ident) bool {
	return a == b || a != nil && b != nil && *a == *b
}

// Owned is the record of the mounts kvmount owns, kept in the state
// directory so that a restart can adopt them and tear down the ones no
// longer configured. It is safe for concurrent use; every change is written
// to disk atomically (temp file, fsync, rename) before it returns.
//
// Changes made at the same time are written together (a group commit):
// while one write is under way, the changes that arrive wait for it and
// the next write carries all of them. A cold start of 1,000 mounts sets
// up all of them at once; written one by one, the record was marshalled and
// fsynced 1,000 times, each time whole.
type Owned struct {
	path     string
	stateDir string
	// dir is the state directory held open (fsutil.OpenPrivateDir):
	// the record is read and written relative to it.
	dir *os.File

	mu      sync.Mutex
	written *sync.Cond // signalled, with mu, when a write ends
	records map[string]Record
	// changes counts the changes to records; saved is the count the last
	// write held, and saveErr its error.
	changes, saved uint64
	saveErr        error
	saving         bool   // a write is under way
	writes         uint64 // writes started, for tests
}

// ownedState is the file format, versioned for later changes.
type ownedState struct {
	Version int               `json:"version"`
	Mounts  map[string]Record `json:"mounts"`
}

// maxOwnedSize bounds what is read of the record, in bytes.
const maxOwnedSize = 64 << 20

// LoadOwned reads the record in stateDir, which it opens with
// fsutil.OpenPrivateDir — creating it (mode 0700) if needed, and refusing
// a directory anyone but root can write or replace (fsutil.ErrNotPrivate):
// a record others could forge would make kvmount take over, and empty, a
// directory of theirs. A missing record is an empty one; the record is
// read without following a symlink or blocking on a FIFO, and must be a
// regular file of at most 64 MiB. Close releases the directory.
func LoadOwned(stateDir string) (*Owned, error) {
	dir, err := fsutil.OpenPrivateDir(stateDir)
	if err != nil {
		return nil, fmt.Errorf("state_dir: %w", err)
	}
	o := &Owned{path: filepath.Join(stateDir, ownedFile), stateDir: stateDir, dir: dir, records: map[string]Record{}}
	o.written = sync.NewCond(&o.mu)
	data, err := readPrivate(dir, ownedFile, maxOwnedSize)
	if errors.Is(err, fs.ErrNotExist) {
		return o, nil
	}
	if err != nil {
		dir.Close()
		return nil, fmt.Errorf("state: %s: %w", o.path, err)
	}
	var st ownedState
	if err := json.Unmarshal(data, &st); err != nil {
		dir.Close()
		return nil, fmt.Errorf("state: %s: %w", o.path, err)
	}
	if st.Version != 1 {
		dir.Close()
		return nil, fmt.Errorf("state: %s: unknown version %d", o.path, st.Version)
	}
	if st.Mounts != nil {
		o.records = st.Mounts
	}
	return o, nil
}

// Close releases the state directory.
func (o *Owned) Close() error { return o.dir.Close() }

// readPrivate reads the file name of dir: opened without following a
// symlink or blocking on a FIFO, a regular file of at most limit bytes.
// A missing file is an error wrapping fs.ErrNotExist.
func readPrivate(dir *os.File, name string, limit int64) ([]byte, error) {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: name, Err: err}
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, &fs.PathError{Op: "fstat", Path: name, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size > limit {
		return nil, fmt.Errorf("%s: not a regular file of at most %d bytes", name, limit)
	}
	return io.ReadAll(io.LimitReader(f, limit))
}

// writePrivate replaces the file name of dir with data, mode 0600,
// atomically and durably: written to name.tmp (created exclusively, a
// stale one removed first), fsynced, renamed over name, and dir fsynced —
// every step relative to dir's handle, following no symlink.
func writePrivate(dir *os.File, name string, data []byte) error {
	tmp := name + ".tmp"
	if err := unix.Unlinkat(int(dir.Fd()), tmp, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return &fs.PathError{Op: "remove", Path: tmp, Err: err}
	}
	fd, err := unix.Openat(int(dir.Fd()), tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return &fs.PathError{Op: "create", Path: tmp, Err: err}
	}
	f := os.NewFile(uintptr(fd), tmp)
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = unix.Renameat(int(dir.Fd()), tmp, int(dir.Fd()), name)
	}
	if err == nil {
		err = dir.Sync()
	}
	if err != nil {
		_ = unix.Unlinkat(int(dir.Fd()), tmp, 0)
		return fmt.Errorf("write %s: %w", name, err)
	}
	return nil
}

// ManifestDir returns the directory that holds the manifests of mount's
// versions: state_dir/manifests/<mount>.
func (o *Owned) ManifestDir(mount string) string {
	return filepath.Join(o.stateDir, manifestsDir, mount)
}

// MakeManifestDir creates mount's manifest directory (ManifestDir) and
// its parent when missing, mode 0700, relative to the state directory's
// handle, and returns its path.
func (o *Owned) MakeManifestDir(mount string) (string, error) {
	parent, _, err := fsutil.MakeDirAt(o.dir, manifestsDir, 0o700, -1, -1)
	if err != nil {
		return "", fmt.Errorf("state: %w", err)
	}
	defer parent.Close()
	d, _, err := fsutil.MakeDirAt(parent, mount, 0o700, -1, -1)
	if err != nil {
		return "", fmt.Errorf("state: %w", err)
	}
	d.Close()
	return o.ManifestDir(mount), nil
}

// RemoveManifestDir removes mount's manifest directory and the manifests
// in it, relative to the state directory's handle; a missing one is no
// error.
func (o *Owned) RemoveManifestDir(mount string) error {
	pfd, err := unix.Openat(int(o.dir.Fd()), manifestsDir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("state: open %s: %w", manifestsDir, err)
	}
	parent := os.NewFile(uintptr(pfd), manifestsDir)
	defer parent.Close()
	fd, err := unix.Openat(pfd, mount, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("state: remove the manifests of mount %q: %w", mount, err)
	}
	d := os.NewFile(uintptr(fd), mount)
	names, err := d.Readdirnames(-1)
	for _, name := range names {
		if err == nil {
			if err = unix.Unlinkat(fd, name, 0); errors.Is(err, unix.ENOENT) {
				err = nil
			}
		}
	}
	d.Close()
	if err == nil {
		if err = unix.Unlinkat(pfd, mount, unix.AT_REMOVEDIR); errors.Is(err, unix.ENOENT) {
			err = nil
		}
	}
	if err != nil {
		return fmt.Errorf("state: remove the manifests of mount %q: %w", mount, err)
	}
	return nil
}

// All returns a copy of every record, by mount name.
func (o *Owned) All() map[string]Record {
	o.mu.Lock()
	defer o.mu.Unlock()
	return maps.Clone(o.records)
}

// Get returns the record of mount name.
func (o *Owned) Get(name string) (Record, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	r, ok := o.records[name]
	return r, ok
}

// Set records mount name as owned and saves the record.
func (o *Owned) Set(name string, r Record) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if old, ok := o.records[name]; ok && old.same(r) && o.saveErr == nil {
		return nil // on disk already
	}
	o.records[name] = r
	return o.commit()
}

// Delete forgets mount name and saves the record.
func (o *Owned) Delete(name string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if _, ok := o.records[name]; !ok && o.saveErr == nil {
		return nil // gone from disk already
	}
	delete(o.records, name)
	return o.commit()
}

// commit returns once a write that holds the change just made to records
// has ended, with that write's error. It writes itself when no write is
// under way; else it waits for the one under way, and a change made after
// that write took its copy goes with the next. Callers hold o.mu, which
// commit releases while it waits and writes.
func (o *Owned) commit() error {
	o.changes++
	mine := o.changes
	for o.saved < mine {
		if o.saving {
			o.written.Wait()
			continue
		}
		o.saving = true
		o.writes++
		upTo := o.changes
		data, err := json.MarshalIndent(ownedState{Version: 1, Mounts: o.records}, "", "  ")
		o.mu.Unlock()
		if err != nil {
			err = fmt.Errorf("state: %w", err)
		} else {
			err = o.save(data)
		}
		o.mu.Lock()
		o.saving = false
		// A later write holds every earlier change too: its error is
		// the one that counts for all of them.
		o.saved, o.saveErr = upTo, err
		o.written.Broadcast()
	}
	return o.saveErr
}

// save writes data as the record, durably (writePrivate).
func (o *Owned) save(data []byte) error {
	if err := writePrivate(o.dir, ownedFile, append(data, '\n')); err != nil {
		return fmt.Errorf("state: %s: %w", o.path, err)
	}
	return nil
}
