package privsep

import (
	"errors"
	"fmt"
	"io/fs"
	"path"

	"github.com/kvmount/kvmount/projector"
)

// ErrRefused is wrapped by every error of Assembler.Add: a message the
// monitor refuses from the worker. The payload being built is dropped;
// the mount keeps its content.
var ErrRefused = errors.New("refused from the worker")

// MountLimits are one mount's guard rails, from the monitor's own
// configuration (projector.Options' fields of the same names): the most
// bytes of one file and of the whole payload (0: no limit), and the most
// files and directories together (0: no limit).
type MountLimits struct {
	MaxValueSize int64
	MaxSize      int64
	MaxFiles     int
	// total is set when MaxSize is what max_total_size leaves, not the
	// mount's own bound.
	total bool
}

// Payload is a payload the monitor assembled from the worker's messages:
// every path passed projector.CleanPath and every limit of its mount. Its
// files carry no owner: owners come from the monitor's configuration.
type Payload struct {
	Mount, Revision string
	Files           projector.Payload
}

// Assembler rebuilds payloads from the worker's messages in the monitor,
// as if the worker were hostile: a payload is for a mount of the
// configuration, its paths pass the kubelet's rules, its modes are
// permission bits, and its files, directories and bytes stay within the
// mount's limits while it arrives — so that no worker makes the monitor
// hold more than one mount's limits allow. It is not safe for concurrent
// use.
type Assembler struct {
	mounts map[string]MountLimits
	// budget, when not nil, returns the most bytes a payload of a mount
	// may hold so that every mount's together stay within max_total_size
	// (Remote.Budget; -1 for no bound).
	budget func(mount string) int64

	// The payload being built, nil between payloads.
	cur *building
}

// building is a payload on its way.
type building struct {
	Payload
	limits   MountLimits
	announce uint32
	dirs     map[string]bool
	bytes    int64
	// file is the path of the file whose bytes come, "" between files;
	// want is its announced size.
	file string
	want uint64
}

// NewAssembler returns an assembler for the mounts of the configuration,
// by name; budget, when not nil, bounds each payload further by what
// max_total_size leaves (Remote.Budget).
func NewAssembler(mounts map[string]MountLimits, budget func(mount string) int64) *Assembler {
	return &Assembler{mounts: mounts, budget: budget}
}

// Add takes the worker's next message. It returns the payload that a
// Commit completes, nil otherwise, and an error wrapping ErrRefused for a
// message that breaks the protocol or a guard rail — naming the mount and
// the path —, after which the payload being built is dropped. Messages
// other than Begin, File, Data and Commit are not its to take.
func (a *Assembler) Add(m Message) (*Payload, error) {
	p, err := a.add(m)
	if err != nil {
		a.cur = nil
		return nil, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	return p, nil
}

func (a *Assembler) add(m Message) (*Payload, error) {
	b := a.cur
	switch m := m.(type) {
	case *Begin:
		if b != nil {
			return nil, fmt.Errorf("mount %q: a payload begun before mount %q's ended", m.Mount, b.Mount)
		}
		limits, ok := a.mounts[m.Mount]
		if !ok {
			return nil, fmt.Errorf("a payload for mount %q, which the configuration does not have", m.Mount)
		}
		if !printable(m.Revision) {
			return nil, fmt.Errorf("mount %q: a revision that is not printable ASCII", m.Mount)
		}
		if limits.MaxFiles > 0 && int64(m.Files) > int64(limits.MaxFiles) {
			return nil, fmt.Errorf("mount %q: a payload of %d files, more than %w (%d)", m.Mount, m.Files, projector.ErrTooManyFiles, limits.MaxFiles)
		}
		if a.budget != nil {
			if left := a.budget(m.Mount); left >= 0 && (limits.MaxSize == 0 || left < limits.MaxSize) {
				limits.MaxSize, limits.total = left, true
			}
		}
		a.cur = &building{
			Payload:  Payload{Mount: m.Mount, Revision: m.Revision, Files: projector.Payload{}},
			limits:   limits,
			announce: m.Files,
			dirs:     map[string]bool{},
		}
		return nil, nil
	case *File:
		if b == nil {
			return nil, fmt.Errorf("file %q outside a payload", m.Path)
		}
		if b.file != "" {
			return nil, fmt.Errorf("mount %q: file %q begun before %q's %d bytes came", b.Mount, m.Path, b.file, b.want)
		}
		return nil, b.addFile(m)
	case *Data:
		if b == nil || b.file == "" {
			return nil, errors.New("file bytes outside a file")
		}
		f := b.Files[b.file]
		if uint64(len(f.Data))+uint64(len(m.Bytes)) > b.want {
			return nil, fmt.Errorf("mount %q: file %q: more bytes than the %d announced", b.Mount, b.file, b.want)
		}
		f.Data = append(f.Data, m.Bytes...)
		b.Files[b.file] = f
		if uint64(len(f.Data)) == b.want {
			b.file = ""
		}
		return nil, nil
	case *Commit:
		if b == nil {
			return nil, errors.New("a commit outside a payload")
		}
		if b.file != "" {
			return nil, fmt.Errorf("mount %q: committed before file %q's %d bytes came", b.Mount, b.file, b.want)
		}
		if uint32(len(b.Files)) != b.announce {
			return nil, fmt.Errorf("mount %q: %d files of the %d announced", b.Mount, len(b.Files), b.announce)
		}
		// The whole payload once more, by the projector's own rule.
		opts := projector.Options{MaxValueSize: b.limits.MaxValueSize, MaxSize: b.limits.MaxSize, MaxFiles: b.limits.MaxFiles}
		if err := projector.CheckLimits(b.Mount, b.Files, opts); err != nil {
			return nil, err
		}
		a.cur = nil
		return &b.Payload, nil
	}
	return nil, fmt.Errorf("message %T is not part of a payload", m)
}

// addFile checks the file m announces against b's rules and limits and
// makes it the current one.
func (b *building) addFile(m *File) error {
	clean, err := projector.CleanPath(m.Path)
	switch {
	case err != nil:
		return fmt.Errorf("mount %q: %w", b.Mount, err)
	case clean != m.Path:
		return fmt.Errorf("mount %q: path %q is not clean (%q)", b.Mount, m.Path, clean)
	case m.Mode&^uint32(fs.ModePerm) != 0:
		return fmt.Errorf("mount %q: file %q: mode %#o holds more than permission bits", b.Mount, m.Path, m.Mode)
	case uint32(len(b.Files)) >= b.announce:
		return fmt.Errorf("mount %q: file %q past the %d announced", b.Mount, m.Path, b.announce)
	case b.limits.MaxValueSize > 0 && m.Size > uint64(b.limits.MaxValueSize):
		return fmt.Errorf("mount %q: file %q of %d bytes exceeds %w (%d bytes)", b.Mount, m.Path, m.Size, projector.ErrValueTooLarge, b.limits.MaxValueSize)
	}
	if _, dup := b.Files[m.Path]; dup || b.dirs[m.Path] {
		return fmt.Errorf("mount %q: path %q given twice, or as a file and a directory", b.Mount, m.Path)
	}
	var newDirs []string
	for dir := path.Dir(m.Path); dir != "." && !b.dirs[dir]; dir = path.Dir(dir) {
		if _, isFile := b.Files[dir]; isFile {
			return fmt.Errorf("mount %q: path %q lies below the file %q", b.Mount, m.Path, dir)
		}
		newDirs = append(newDirs, dir)
	}
	entries := len(b.Files) + len(b.dirs) + len(newDirs) + 1
	if b.limits.MaxFiles > 0 && entries > b.limits.MaxFiles {
		return fmt.Errorf("mount %q: file %q makes %d files and directories, more than %w (%d)", b.Mount, m.Path, entries, projector.ErrTooManyFiles, b.limits.MaxFiles)
	}
	size := b.bytes + int64(len(newDirs))*projector.DirectoryCost()
	if b.limits.total && (m.Size > uint64(b.limits.MaxSize) || size+int64(m.Size) > b.limits.MaxSize) {
		return fmt.Errorf("mount %q: file %q takes the payloads of every mount past max_total_size (%d bytes left for this one)", b.Mount, m.Path, b.limits.MaxSize)
	}
	if b.limits.MaxSize > 0 && (m.Size > uint64(b.limits.MaxSize) || size+int64(m.Size) > b.limits.MaxSize) {
		return fmt.Errorf("mount %q: file %q takes the payload past %w (%d bytes)", b.Mount, m.Path, projector.ErrMountTooLarge, b.limits.MaxSize)
	}
	if b.limits.MaxSize == 0 && b.limits.MaxValueSize == 0 && m.Size > maxUnlimitedFile {
		return fmt.Errorf("mount %q: file %q of %d bytes, more than any file kvmount writes (%d)", b.Mount, m.Path, m.Size, maxUnlimitedFile)
	}
	for _, dir := range newDirs {
		b.dirs[dir] = true
	}
	b.bytes = size + int64(m.Size)
	b.Files[m.Path] = projector.File{Mode: fs.FileMode(m.Mode), Data: make([]byte, 0, min(m.Size, MaxChunk))}
	if m.Size > 0 {
		b.file, b.want = m.Path, m.Size
	}
	return nil
}

// maxUnlimitedFile bounds a file of a mount that sets neither
// max_value_size nor max_mount_size, in bytes.
const maxUnlimitedFile = 1 << 30

// printable reports whether s is printable ASCII, as revisions are
// (source.BoundRevision).
func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
