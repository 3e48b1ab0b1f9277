package projector

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// Medium is where a mount lives: a plain directory (disk), or a tmpfs that
// kvmount mounts at the directory — the kubelet's emptyDir medium "" and
// Memory. It takes plain options; the atomic writer then writes into the
// directory Prepare returns.
type Medium struct {
	// Dir is the mount directory, absolute.
	Dir string
	// Tmpfs mounts a tmpfs at Dir.
	Tmpfs bool
	// SizeLimit bounds a tmpfs mount's payload, in bytes as TmpfsBytes
	// counts them; the tmpfs is sized TmpfsSize(SizeLimit).
	SizeLimit int64
	// MaxFiles bounds the files of a payload (max_files); a tmpfs gets
	// TmpfsInodes(SizeLimit, MaxFiles) inodes. Zero means no bound.
	MaxFiles int
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

// DirectoryCost returns what a directory counts against max_mount_size
// (CheckLimits), in bytes: a page (os.Getpagesize), which it takes on
// tmpfs, as a block does on disk.
func DirectoryCost() int64 { return pageSize }

// TmpfsSize returns the size, in bytes, of the tmpfs of a mount whose
// payload may take sizeLimit bytes: three times sizeLimit — the current
// version, the version being built (every file changed) and a replaced
// version kept for readers (WriterOptions.Grace) — plus 1 MiB for the
// layout's symlinks and directories. A tmpfs takes memory only for what is
// written, so this is a bound, not memory used.
func TmpfsSize(sizeLimit int64) int64 {
	return 3*sizeLimit + 1<<20
}

// TmpfsInodes returns the inode limit (tmpfs nr_inodes) of the tmpfs of a
// mount whose payload may hold maxFiles files and take sizeLimit bytes: one
// version holds at most maxFiles files and as many directories, and no
// more files and directories than sizeLimit has pages (TmpfsBytes counts a
// page for each), plus its own directory; three versions (as TmpfsSize),
// the visible symlinks of one, and a few for the layout. (Linux counts a
// hard link as an inode too, and kvmount links the unchanged files of one
// version into the next: they are in the three versions' count.) Each inode costs the kernel about 1 KiB
// that no size limit sees: 100,000 empty keys once put 200,003 inodes and
// 205 MB of kernel memory into a 64 KiB tmpfs.
func TmpfsInodes(sizeLimit int64, maxFiles int) int64 {
	perVersion := sizeLimit / pageSize
	if maxFiles > 0 {
		perVersion = min(perVersion, 2*int64(maxFiles))
	}
	perVersion++ // the version directory itself
	return 4*perVersion + 16
}

// TmpfsBytes returns what payload counts against a tmpfs mount's
// size_limit, in bytes: each file's data rounded up to whole pages, with at
// least one page for every file (an empty one too) and one for every
// directory — so that many small or empty files cannot fill the host's
// memory through inodes and directory entries that a byte count does not
// see.
func TmpfsBytes(payload Payload) int64 {
	var pages int64
	for _, f := range payload {
		pages += max(1, (int64(len(f.Data))+pageSize-1)/pageSize)
	}
	pages += int64(len(directories(payload)))
	return pages * pageSize
}

// CheckFits returns an error when payload does not fit a tmpfs mount's
// SizeLimit (see TmpfsBytes); nil on disk.
func (m Medium) CheckFits(payload Payload) error {
	if !m.Tmpfs {
		return nil
	}
	if need := TmpfsBytes(payload); need > m.SizeLimit {
		return fmt.Errorf("the payload needs %d bytes of tmpfs (its files and directories count in %d-byte pages, at least one each), more than size_limit (%d bytes)", need, pageSize, m.SizeLimit)
	}
	return nil
}

func (m Medium) tmpfsOptions() fsutil.TmpfsOptions {
	return fsutil.TmpfsOptions{Size: TmpfsSize(m.SizeLimit), Inodes: TmpfsInodes(m.SizeLimit, m.MaxFiles), Mode: m.Mode, UID: m.UID, GID: m.GID}
}

// Owner is what kvmount recorded of a mount directory it owns, to recognise
// it (fsutil.Recognize): nil identities are unknown (nothing recorded yet),
// and then whatever is found is taken.
type Owner struct {
	// Dir identifies the mount directory on its parent's file system: the
	// directory itself on disk, the directory the tmpfs is mounted on.
	Dir *fsutil.Ident
	// Tmpfs identifies the root of kvmount's tmpfs mounted there.
	Tmpfs *fsutil.Ident
	// Marker is the token of the marker (fsutil.MarkerAttr) that the
	// mount directory and its tmpfs's root carry, or are given: the
	// identity that survives a remount or reboot renumbering the file
	// system. "" where the file system keeps none.
	Marker string
}

// dir returns what o records of the mount directory.
func (o Owner) dir() fsutil.Owned { return fsutil.Owned{Ident: o.Dir, Marker: o.Marker} }

// tmpfs returns what o records of the root of kvmount's tmpfs.
func (o Owner) tmpfs() fsutil.Owned { return fsutil.Owned{Ident: o.Tmpfs, Marker: o.Marker} }

// MountDir is a mount directory Prepare made ready: the directory to write
// into, held open, and how to recognise it next time.
type MountDir struct {
	// File is the directory the atomic writer writes into: Dir itself on
	// disk, the root of kvmount's tmpfs on tmpfs. The caller closes it.
	File *os.File
	// Owner is to be recorded, replacing what was.
	Owner Owner
	// Created reports that Prepare created Dir.
	Created bool
	// Readopted reports that Dir's file system keeps no marker and was
	// renumbered, and that Prepare took Dir over because only root could
	// have put it at its path (fsutil.RecognizeOrReadopt): the caller
	// says so in its log.
	Readopted bool
	// marker is the token being given, "" once a file system keeps none.
	marker string
}

// Prepare makes Dir ready for an atomic writer and returns it open. Dir is
// reached without following a symlink in any component
// (fsutil.OpenNoFollow). Prepare creates Dir when missing (its missing
// parents get 0755 and root's owner), mounts kvmount's tmpfs there (or
// remounts the one a previous run left, applying size, inodes, mode and
// owner and keeping the content), and gives the directory written into its
// mode and owner, and no ACL, through its handle. before is called, with
// whether Dir is about to be created, before anything is created or
// mounted, so that the caller can record what it will own first.
//
// owner is what a previous run recorded, and marker the token of the
// marker to give the directory: owner.Marker, or a new one when owner has
// none, which the caller records from MountDir.Owner once Prepare has
// given it. A directory found
// at Dir that fsutil.Recognize does not take for the one owner records is
// refused with fsutil.ErrReplaced (and fsutil.ErrUnrecognized where
// kvmount cannot tell) and left untouched: someone who can write one of
// Dir's parents replaced the directory kvmount owns, and kvmount never
// takes over whatever the path reaches now. A Dir that does not exist is
// created anew. The directory taken, and the root of its tmpfs, are given
// the marker where their file system keeps one; MountDir.Owner.Marker is ""
// where it does not.
//
// Other errors: a symlink in Dir's path (fsutil.ErrSymlink, and
// fsutil.ErrNotDir at Dir itself) or anything else than a directory
// (fsutil.ErrNotDir); a non-empty directory that a new tmpfs would hide
// (ErrWouldHide); another file system mounted at Dir
// (fsutil.ErrForeignMount); and those of mkdir, mount, chmod, chown and
// setxattr.
func (m Medium) Prepare(owner Owner, marker string, before func(createDir bool) error) (*MountDir, error) {
	md := &MountDir{Owner: owner, marker: marker}
	d, err := fsutil.OpenDir(m.Dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := before(true); err != nil {
			return nil, err
		}
		d, md.Created, err = fsutil.MakeDir(m.Dir, m.Mode, m.UID, m.GID)
		if err == nil && md.Created {
			md.Owner = Owner{}
		}
	}
	if err != nil {
		return nil, err
	}
	defer func() {
		if d != nil {
			d.Close()
		}
	}()
	if m.Tmpfs {
		if err := m.prepareTmpfs(&d, md, before); err != nil {
			return nil, err
		}
	} else {
		if err := m.takeDir(d, md); err != nil {
			return nil, err
		}
	}
	md.Owner.Marker = md.marker
	// A directory someone else made, or a reload that changed the mode or
	// owner: take it over, inherited ACLs included.
	if err := fsutil.StripACL(d); err != nil {
		return nil, err
	}
	if err := fsutil.SetDirAttrs(d, m.Mode, m.UID, m.GID); err != nil {
		return nil, err
	}
	md.File, d = d, nil
	return md, nil
}

// takeDir recognises d, the mount directory (fsutil.Recognize; a directory
// Prepare just created is taken as it is), marks it and records its
// identity in md.Owner.
func (m Medium) takeDir(d *os.File, md *MountDir) error {
	if !md.Created {
		readopted, err := fsutil.RecognizeOrReadopt(d, m.Dir, md.Owner.dir())
		if err != nil {
			return err
		}
		md.Readopted = md.Readopted || readopted
	}
	ident, err := fsutil.IdentOf(d)
	if err != nil {
		return err
	}
	md.Owner.Dir = &ident
	return mark(d, &md.marker)
}

// mark gives d the marker *token unless it carries it already; where d's
// file system keeps no marker, *token becomes "".
func mark(d *os.File, token *string) error {
	if *token == "" {
		return nil
	}
	got, err := fsutil.ReadMarker(d)
	if err == nil && got == *token {
		return nil
	}
	if err == nil {
		err = fsutil.SetMarker(d, *token)
	}
	if errors.Is(err, fsutil.ErrNoMarker) {
		*token = ""
		return nil
	}
	return err
}

// prepareTmpfs mounts or remounts kvmount's tmpfs on *d, replacing *d with
// the tmpfs's root.
func (m Medium) prepareTmpfs(d **os.File, md *MountDir, before func(createDir bool) error) error {
	state, info, err := fsutil.MountAt(*d)
	if err != nil {
		return err
	}
	switch state {
	case fsutil.ForeignMount:
		return fmt.Errorf("%s: %w (%s of source %q); kvmount leaves it alone — unmount it or choose another dir", m.Dir, fsutil.ErrForeignMount, info.FSType, info.Source)
	case fsutil.OwnTmpfs:
		readopted, err := fsutil.RecognizeOrReadopt(*d, m.Dir, md.Owner.tmpfs())
		if err != nil {
			return err
		}
		md.Readopted = md.Readopted || readopted
		if err := fsutil.RemountTmpfs(*d, m.tmpfsOptions()); err != nil {
			return err
		}
	default:
		if err := m.takeDir(*d, md); err != nil {
			return err
		}
		names, err := (*d).Readdirnames(1)
		if err != nil && err != io.EOF {
			return err
		}
		if len(names) > 0 {
			return fmt.Errorf("%s holds %s: %w; empty the directory or choose another", m.Dir, names[0], ErrWouldHide)
		}
		if !md.Created {
			if err := before(false); err != nil {
				return err
			}
		}
		root, err := fsutil.MountTmpfs(*d, m.tmpfsOptions())
		if err != nil {
			return err
		}
		(*d).Close()
		*d = root
	}
	ident, err := fsutil.IdentOf(*d)
	if err != nil {
		return err
	}
	md.Owner.Tmpfs = &ident
	return mark(*d, &md.marker)
}

// Open opens the existing mount directory Dir to tear it down, without
// following a symlink in any component and checking that it is the one
// owner identifies (fsutil.Recognize; fsutil.ErrReplaced otherwise): the root of kvmount's
// tmpfs when one is mounted there, else Dir itself. A missing Dir is an
// error wrapping fs.ErrNotExist.
func (m Medium) Open(owner Owner) (*os.File, error) {
	d, err := fsutil.OpenDir(m.Dir)
	if err != nil {
		return nil, err
	}
	want := owner.dir()
	if state, _, err := fsutil.MountAt(d); err != nil {
		d.Close()
		return nil, err
	} else if state == fsutil.OwnTmpfs {
		want = owner.tmpfs()
	}
	if err := fsutil.Recognize(d, m.Dir, want); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// Release undoes Prepare once the writer has torn the mount down: it
// unmounts kvmount's tmpfs (whose root is Open's handle) and, when
// removeDir is set, removes Dir if it is empty and still the directory
// owner identifies, through its parent's handle. A missing Dir is no
// error; a Dir that still holds files is kept (ErrDirKept); a Dir that is
// another directory now is left alone (fsutil.ErrReplaced).
func (m Medium) Release(owner Owner, removeDir bool) error {
	d, err := m.Open(owner)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if m.Tmpfs {
		err := fsutil.UnmountTmpfs(d)
		d.Close()
		if err != nil {
			return err
		}
		// The directory below the tmpfs.
		if d, err = fsutil.OpenDir(m.Dir); err != nil {
			return err
		}
		if err := fsutil.Recognize(d, m.Dir, owner.dir()); err != nil {
			d.Close()
			return err
		}
	}
	d.Close()
	if !removeDir {
		return nil
	}
	parentPath, name := filepath.Split(m.Dir)
	parent, err := fsutil.OpenNoFollow(parentPath, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer parent.Close()
	err = unix.Unlinkat(int(parent.Fd()), name, unix.AT_REMOVEDIR)
	switch {
	case err == nil:
		return parent.Sync()
	case errors.Is(err, unix.ENOENT):
		return nil
	case errors.Is(err, unix.ENOTEMPTY) || errors.Is(err, unix.EEXIST) || errors.Is(err, unix.EBUSY):
		return fmt.Errorf("%w: %w", ErrDirKept, &fs.PathError{Op: "rmdir", Path: m.Dir, Err: err})
	}
	return &fs.PathError{Op: "rmdir", Path: m.Dir, Err: err}
}
