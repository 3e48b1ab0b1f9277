package daemon

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
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

// lockStateDir creates stateDir if needed (mode 0700; a wider mode is
// tightened to 0700, as the directory holds the record of owned mounts),
// and takes an exclusive flock(2) on its kvmount.lock, without waiting. The
// lock file then holds this process's PID. When another process holds the
// lock, it returns an error wrapping ErrLocked that names the lock file and,
// where the file tells it, the holder's PID. The lock is released by
// release, or by the kernel when the process ends however it ends.
func lockStateDir(stateDir string) (*stateLock, error) {
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	info, err := os.Stat(stateDir)
	if err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	if info.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(stateDir, 0o700); err != nil {
			return nil, fmt.Errorf("state: %w", err)
		}
	}
	path := filepath.Join(stateDir, LockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("state: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			holder := ""
			if data, err := os.ReadFile(path); err == nil {
				if pid, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && pid > 0 {
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
