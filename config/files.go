package config

import (
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// Files is where the configuration reads the files it names — credential
// files, TLS certificates and keys, template files — and where a source
// reads a credential file again while it runs (ReadSecretFile's rules).
// Disk reads them from the file system; a Recorder keeps a copy of what
// it read, and Replay serves those copies: so the monitor reads every
// file once and the unprivileged worker, which may read none of them,
// decodes the same configuration from the copies (privsep).
type Files interface {
	// Read returns the content of the regular file name, at most limit
	// bytes, and its status (owner and mode, for warnings). It returns an
	// error for a file that cannot be read, is not regular, or is larger
	// than limit; the error names the file, never its content.
	Read(name string, limit int64) ([]byte, *unix.Stat_t, error)
}

// Disk reads files from the file system: opened without following a
// symlink in any component and without blocking (fsutil.OpenNoFollow),
// type checked with fstat.
type Disk struct{}

// Read implements Files.
func (Disk) Read(name string, limit int64) ([]byte, *unix.Stat_t, error) {
	f, err := fsutil.OpenNoFollow(name, unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, nil, fmt.Errorf("%s is not a regular file", name)
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, nil, err
	}
	if int64(len(data)) > limit {
		return nil, nil, fmt.Errorf("%s is larger than %d bytes", name, limit)
	}
	return data, &st, nil
}

// Recorder reads through Files (Disk when nil) and keeps a copy of every
// file read successfully, by name. It is safe for concurrent use.
type Recorder struct {
	Files Files

	mu   sync.Mutex
	read map[string][]byte
}

// Read implements Files.
func (r *Recorder) Read(name string, limit int64) ([]byte, *unix.Stat_t, error) {
	files := r.Files
	if files == nil {
		files = Disk{}
	}
	data, st, err := files.Read(name, limit)
	if err == nil {
		r.mu.Lock()
		if r.read == nil {
			r.read = map[string][]byte{}
		}
		r.read[name] = data
		r.mu.Unlock()
	}
	return data, st, err
}

// Recorded returns the files read so far, by name. The map is a copy; the
// contents are shared and must not be modified.
func (r *Recorder) Recorded() map[string][]byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string][]byte, len(r.read))
	for name, data := range r.read {
		out[name] = data
	}
	return out
}

// Replay serves files from a set of copies, by name, as a Recorder kept
// them: each as a regular file of root's, mode 0600. A name it does not
// hold is an error wrapping os.ErrNotExist.
type Replay map[string][]byte

// Read implements Files.
func (r Replay) Read(name string, limit int64) ([]byte, *unix.Stat_t, error) {
	data, ok := r[name]
	if !ok {
		return nil, nil, fmt.Errorf("%s: %w (not passed to the worker)", name, os.ErrNotExist)
	}
	if int64(len(data)) > limit {
		return nil, nil, fmt.Errorf("%s is larger than %d bytes", name, limit)
	}
	return data, &unix.Stat_t{Mode: unix.S_IFREG | 0o600, Size: int64(len(data))}, nil
}
