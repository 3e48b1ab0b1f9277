package projector

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// Reading a version back from the disk: at adoption without a usable
// manifest, and at every verification.

// errVersionTooLarge means a version on disk holds more files, or a larger
// file, than any payload of the mount may (WriterOptions.MaxFiles,
// MaxFileSize): it is not read, and the next Write rewrites it.
var errVersionTooLarge = errors.New("holds more than a payload of this mount may")

// readVersion reads every file of the version directory name, and reports
// whether it and every directory inside it have the writer's mode and
// owner. It goes through handles only: each directory opened relative to
// its parent with O_DIRECTORY|O_NOFOLLOW, each file with
// O_NOFOLLOW|O_NONBLOCK and its type checked with fstat on the descriptor
// before a byte is read — a user who can write the version's directories
// (DirUID) and swaps an entry for a FIFO or a symlink between the listing
// and the open (renameat2 RENAME_EXCHANGE) gets an error, never a read
// that blocks or follows. A file over WriterOptions.MaxFileSize, or more
// files than MaxFiles, is an error wrapping errVersionTooLarge before
// anything large is read. Entries of the version's top level whose name
// starts with ".." (an older kvmount's manifest) are skipped.
func (w *AtomicWriter) readVersion(name string) (payload Payload, dirsMatch bool, err error) {
	d, err := w.openVersion(name)
	if err != nil {
		return nil, false, err
	}
	defer d.Close()
	payload, dirsMatch = Payload{}, true
	var walk func(d *os.File, rel string) error
	walk = func(d *os.File, rel string) error {
		var st unix.Stat_t
		if err := unix.Fstat(int(d.Fd()), &st); err != nil {
			return err
		}
		dirsMatch = dirsMatch && w.dirAttrsMatch(st)
		names, err := d.Readdirnames(-1)
		if err != nil {
			return err
		}
		for _, base := range names {
			p := path.Join(rel, base)
			if rel == "" && strings.HasPrefix(base, "..") {
				continue
			}
			fd, err := unix.Openat(int(d.Fd()), base, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			f := os.NewFile(uintptr(fd), p)
			err = w.readEntry(f, p, payload, walk)
			f.Close()
			if err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(d, ""); err != nil {
		return nil, false, fmt.Errorf("atomic writer: read version %s: %w", name, err)
	}
	return payload, dirsMatch, nil
}

// readEntry reads the open entry f at path p of a version into payload, or
// walks it when it is a directory.
func (w *AtomicWriter) readEntry(f *os.File, p string, payload Payload, walk func(*os.File, string) error) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return walk(f, p)
	case unix.S_IFREG:
	default:
		return fmt.Errorf("%s is not a regular file", p)
	}
	if w.opts.MaxFiles > 0 && len(payload) >= w.opts.MaxFiles {
		return fmt.Errorf("more than %d files: %w", w.opts.MaxFiles, errVersionTooLarge)
	}
	if w.opts.MaxFileSize > 0 && st.Size > w.opts.MaxFileSize {
		return fmt.Errorf("%s has %d bytes: %w", p, st.Size, errVersionTooLarge)
	}
	// Bounded even if the file grows while it is read.
	limit := st.Size + 1
	if w.opts.MaxFileSize > 0 {
		limit = w.opts.MaxFileSize + 1
	}
	data, err := io.ReadAll(io.LimitReader(f, limit))
	if err != nil {
		return err
	}
	if w.opts.MaxFileSize > 0 && int64(len(data)) > w.opts.MaxFileSize {
		return fmt.Errorf("%s grew past %d bytes: %w", p, w.opts.MaxFileSize, errVersionTooLarge)
	}
	payload[p] = File{Data: data, Mode: fs.FileMode(st.Mode).Perm(), UID: int(st.Uid), GID: int(st.Gid)}
	return nil
}
