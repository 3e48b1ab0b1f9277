package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/kvmount/kvmount/fsutil"
)

// Medium is where a mount lives: a plain directory (disk), or a tmpfs that
// kvmount mounts at the directory — the kubelet's emptyDir medium "" and
// Memory. It takes plain options; the atomic writer then writes into Dir.
type Medium struct {
	// Dir is the mount directory, absolute.
	Dir string
	// Tmpfs mounts a tmpfs at Dir.
	Tmpfs bool
	// SizeLimit bounds a tmpfs mount's payload, in bytes; the tmpfs is
	// sized TmpfsSize(SizeLimit).
	SizeLimit int64
	// Mode, UID and GID are Dir's permission and owner (-1 keeps
	// kvmount's user or group).
	Mode     fs.FileMode
	UID, GID int
}

// ErrWouldHide is returned by Prepare for a non-empty directory where a
// tmpfs would hide files.
var ErrWouldHide = errors.New("a tmpfs would hide the files there")

// ErrDirKept is returned (wrapped) by Release when the mount directory
// kvmount created still holds files it did not write, and stays.
var ErrDirKept = errors.New("mount directory kept")

// pageSize is the unit in which tmpfs allocates file data, in bytes.
var pageSize = int64(os.Getpagesize())

// TmpfsSize returns the size, in bytes, of the tmpfs of a mount whose
// payload may take sizeLimit bytes: three times sizeLimit — the current
// version, the version being built (every file changed) and a replaced
// version kept for readers (WriterOptions.Grace) — plus 1 MiB for the
// layout's symlinks and directories. A tmpfs takes memory only for what is
// written, so this is a bound, not memory used.
func TmpfsSize(sizeLimit int64) int64 {
	return 3*sizeLimit + 1<<20
}

// TmpfsBytes returns the memory payload's files take on a tmpfs, in bytes:
// each file's size rounded up to whole pages.
func TmpfsBytes(payload Payload) int64 {
	var n int64
	for _, f := range payload {
		n += (int64(len(f.Data)) + pageSize - 1) / pageSize * pageSize
	}
	return n
}

// CheckFits returns an error when payload does not fit a tmpfs mount's
// SizeLimit (page-rounded, see TmpfsBytes); nil on disk.
func (m Medium) CheckFits(payload Payload) error {
	if !m.Tmpfs {
		return nil
	}
	if need := TmpfsBytes(payload); need > m.SizeLimit {
		return fmt.Errorf("the payload needs %d bytes of tmpfs (files round up to %d-byte pages), more than size_limit (%d bytes)", need, pageSize, m.SizeLimit)
	}
	return nil
}

// Prepare makes Dir ready for an atomic writer: it creates it when missing
// (parents 0755), mounts kvmount's tmpfs there (or remounts the one a
// previous run left, applying size, mode and owner and keeping the
// content), and gives Dir its mode and owner through a handle — never
// through a symlink. before is called, with whether Dir is about to be
// created, before anything is created or mounted, so that the caller can
// record what it will own first. It returns whether it created Dir.
//
// Errors: Dir is a symlink or not a directory (fsutil.ErrNotDir); a
// non-empty directory would be hidden by a new tmpfs (ErrWouldHide);
// another file system is mounted at Dir (fsutil.ErrForeignMount); and
// those of mkdir, mount, chmod and chown.
func (m Medium) Prepare(before func(createDir bool) error) (created bool, err error) {
	exists, err := fsutil.DirExists(m.Dir)
	if err != nil {
		return false, err
	}
	if !exists {
		if err := before(true); err != nil {
			return false, err
		}
		if err := fsutil.MakeDir(m.Dir, m.Mode, m.UID, m.GID); err != nil {
			return false, err
		}
		created = true
	}
	if m.Tmpfs {
		state, err := fsutil.MountStateOf(m.Dir)
		if err != nil {
			return created, err
		}
		switch state {
		case fsutil.ForeignMount:
			return created, fmt.Errorf("%s: %w; kvmount leaves it alone — unmount it or choose another dir", m.Dir, fsutil.ErrForeignMount)
		case fsutil.NotMounted:
			entries, err := os.ReadDir(m.Dir)
			if err != nil {
				return created, err
			}
			if len(entries) > 0 {
				return created, fmt.Errorf("%s holds %s (and %d more): %w; empty the directory or choose another", m.Dir, entries[0].Name(), len(entries)-1, ErrWouldHide)
			}
			if !created {
				if err := before(false); err != nil {
					return created, err
				}
			}
		}
		if err := fsutil.MountTmpfs(m.Dir, fsutil.TmpfsOptions{Size: TmpfsSize(m.SizeLimit), Mode: m.Mode, UID: m.UID, GID: m.GID}); err != nil {
			return created, err
		}
	}
	// A reload or restart may have changed the directory's mode or owner.
	d, err := fsutil.OpenDir(m.Dir)
	if err != nil {
		return created, err
	}
	defer d.Close()
	return created, fsutil.SetDirAttrs(d, m.Mode, m.UID, m.GID)
}

// Release undoes Prepare once the writer has torn the mount down: it
// unmounts kvmount's tmpfs and, when removeDir is set, removes Dir if it is
// empty. A missing Dir is no error; a symlink at Dir is refused
// (fsutil.ErrNotDir) with nothing behind it touched; a Dir that still holds
// files is kept (ErrDirKept).
func (m Medium) Release(removeDir bool) error {
	if exists, err := fsutil.DirExists(m.Dir); err != nil || !exists {
		return err
	}
	if m.Tmpfs {
		if err := fsutil.UnmountTmpfs(m.Dir); err != nil {
			return err
		}
	}
	if removeDir {
		if err := os.Remove(m.Dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%w: %w", ErrDirKept, err)
		}
	}
	return nil
}
