package reconcile

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"sync"

	"github.com/google/renameio/v2"
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

// LoadOwned reads the record in stateDir, creating the directory (mode
// 0700) if needed. A missing record is an empty one.
func LoadOwned(stateDir string) (*Owned, error) {
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	o := &Owned{path: filepath.Join(stateDir, ownedFile), stateDir: stateDir, records: map[string]Record{}}
	o.written = sync.NewCond(&o.mu)
	data, err := os.ReadFile(o.path)
	if errors.Is(err, fs.ErrNotExist) {
		return o, nil
	}
	if err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	var st ownedState
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("state: %s: %w", o.path, err)
	}
	if st.Version != 1 {
		return nil, fmt.Errorf("state: %s: unknown version %d", o.path, st.Version)
	}
	if st.Mounts != nil {
		o.records = st.Mounts
	}
	return o, nil
}

// ManifestDir returns the directory that holds the manifests of mount's
// versions: state_dir/manifests/<mount>.
func (o *Owned) ManifestDir(mount string) string {
	return filepath.Join(o.stateDir, manifestsDir, mount)
}

// MakeManifestDir creates mount's manifest directory (ManifestDir) and
// its parent when missing, mode 0700, without following a symlink in any
// component, and returns its path.
func (o *Owned) MakeManifestDir(mount string) (string, error) {
	dir := o.ManifestDir(mount)
	parent, _, err := fsutil.MakeDir(filepath.Dir(dir), 0o700, -1, -1)
	if err != nil {
		return "", fmt.Errorf("state: %w", err)
	}
	defer parent.Close()
	d, _, err := fsutil.MakeDirAt(parent, mount, 0o700, -1, -1)
	if err != nil {
		return "", fmt.Errorf("state: %w", err)
	}
	d.Close()
	return dir, nil
}

// RemoveManifestDir removes mount's manifest directory and the manifests
// in it; a missing one is no error.
func (o *Owned) RemoveManifestDir(mount string) error {
	dir := o.ManifestDir(mount)
	d, err := fsutil.OpenDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("state: %w", err)
	}
	names, err := d.Readdirnames(-1)
	for _, name := range names {
		if err == nil {
			if err = unix.Unlinkat(int(d.Fd()), name, 0); errors.Is(err, unix.ENOENT) {
				err = nil
			}
		}
	}
	d.Close()
	if err != nil {
		return fmt.Errorf("state: remove the manifests of mount %q: %w", mount, err)
	}
	parent, err := fsutil.OpenDir(filepath.Dir(dir))
	if err != nil {
		return fmt.Errorf("state: %w", err)
	}
	defer parent.Close()
	if err := unix.Unlinkat(int(parent.Fd()), mount, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
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

// save writes data as the record, durably.
func (o *Owned) save(data []byte) error {
	if err := renameio.WriteFile(o.path, append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	// renameio syncs the file before the rename; the rename itself is
	// durable once the directory is synced.
	if err := fsutil.SyncDir(filepath.Dir(o.path)); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	return nil
}
