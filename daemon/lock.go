package daemon

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
)

// LockFile is the name of the lock file in the state directory.
const LockFile = "kvmount.lock"

// ErrLocked is returned by Run and Once when another kvmount process holds
// the lock on the same state directory: two daemons writing the same mounts
// would remove each other's versions.
var ErrLocked = errors.New("another kvmount is running with this state directory")

// stateLock is the exclusive lock on a state directory, held for the life
// of a run.
type stateLock struct{ f *os.File }

// lockStateDir opens stateDir with fsutil.OpenPrivateDir — creating it
// (mode 0700) if needed, tightening a wider mode to 0700, refusing one that
// anyone but root can write or replace — and takes an exclusive flock(2)
// on its kvmount.lock, opened relative to the directory's handle without
// following a symlink or blocking on a FIFO, without waiting. The lock
// file then holds this process's PID. When another process holds the
// lock, it returns an error wrapping ErrLocked that names the lock file
// and, where the file tells it, the holder's PID. The lock is released by
// release, or by the kernel when the process ends however it ends.
func lockStateDir(stateDir string) (*stateLock, error) {
	dir, err := fsutil.OpenPrivateDir(stateDir)
	if err != nil {
		return nil, fmt.Errorf("state_dir: %w", err)
	}
	defer dir.Close()
	path := filepath.Join(stateDir, LockFile)
	fd, err := unix.Openat(int(dir.Fd()), LockFile, unix.O_RDWR|unix.O_CREAT|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("state: %w", &fs.PathError{Op: "open", Path: path, Err: err})
	}
	f := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		f.Close()
		return nil, fmt.Errorf("state: %s is not a regular file", path)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			holder := ""
			buf := make([]byte, 32)
			if n, err := f.ReadAt(buf, 0); n > 0 && (err == nil || errors.Is(err, io.EOF)) {
				if pid, err := strconv.Atoi(strings.TrimSpace(string(buf[:n]))); err == nil && pid > 0 {
					holder = fmt.Sprintf(" (pid %d)", pid)
				}
			}
			return nil, fmt.Errorf("state: %w: %s is locked%s", ErrLocked, path, holder)
		}
		return nil, &fs.PathError{Op: "flock", Path: path, Err: err}
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &stateLock{f: f}, nil
}

// release gives the lock up.
func (l *stateLock) release() {
	if l != nil && l.f != nil {
		l.f.Close()
		l.f = nil
	}
}
