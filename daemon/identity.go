package daemon

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/privsep"
)

// WorkerGroup is the group the workers run in, which the packages create
// (sysusers.d). Each worker runs as a user id of its own (dynamicUsers);
// the group is what they share, so that a firewall can tell their
// connections (nftables' meta skgid, iptables' --gid-owner). Where it does
// not exist, each worker's group is its user id.
const WorkerGroup = "kvmount"

// Dynamic user ids, as systemd allocates them for DynamicUser= (systemd's
// "UID/GID Ranges": 61184–65519).
const (
	dynamicFirst = 61184
	dynamicLast  = 65519
)

// dynamicLockDir is where systemd locks the dynamic ids it hands out, a
// file per id (/run/systemd/dynamic-uid/UID, flock(2)ed for as long as the
// id is in use; systemd's src/core/dynamic-user.c). kvmount takes its ids
// the same way, so that neither a DynamicUser= unit nor another kvmount
// takes an id a worker holds.
const dynamicLockDir = "/run/systemd/dynamic-uid"

// dynamicUsers hands each trust domain's worker a user of its own: an id
// of systemd's dynamic range that no user, group or running process holds,
// locked as systemd locks the ids of DynamicUser= units, held until the
// worker is gone for good. Workers of different domains never share a
// user, so nothing the kernel grants a user spans two domains: the count
// of tasks against RLIMIT_NPROC (one worker's threads up to its bound
// leave another's pthread_create failing), signals, prlimit(2), ptrace.
// It is safe for concurrent use.
type dynamicUsers struct {
	// group is the workers' group id, or -1 for each its user id.
	group   int
	lockDir string

	mu sync.Mutex
	// next is where the next search begins.
	next int
}

// newDynamicUsers returns the users of the workers, in the group named
// (WorkerGroup for "") where it exists. It returns an error when that
// group is root's.
func newDynamicUsers(group string) (*dynamicUsers, error) {
	if group == "" {
		group = WorkerGroup
	}
	u := &dynamicUsers{group: -1, lockDir: dynamicLockDir, next: dynamicStart(os.Getpid())}
	if g, err := user.LookupGroup(group); err == nil {
		gid, _ := strconv.Atoi(g.Gid)
		if gid == 0 {
			return nil, fmt.Errorf("the workers' group %s is root's", group)
		}
		u.group = gid
	}
	return u, nil
}

// take returns the identity of domain's worker — a free dynamic id, locked
// under lockDir, with the workers' group — and the function that unlocks
// it. It returns an error when the lock directory cannot be used safely or
// no id of the range is free.
func (u *dynamicUsers) take(domain string) (privsep.Identity, func(), error) {
	dir, err := u.openLockDir()
	if err != nil {
		return privsep.Identity{}, nil, err
	}
	defer dir.Close()
	u.mu.Lock()
	defer u.mu.Unlock()
	running := runningIDs()
	size := dynamicLast - dynamicFirst + 1
	for i := range size {
		id := dynamicFirst + (u.next-dynamicFirst+i)%size
		if running[id] || known(id) {
			continue
		}
		lock, err := lockID(dir, id)
		if err != nil {
			return privsep.Identity{}, nil, err
		}
		if lock == nil {
			continue // another holds it
		}
		u.next = dynamicFirst + (id-dynamicFirst+1)%size
		gid := u.group
		if gid < 0 {
			gid = id
		}
		release := func() {
			// Unlinked before it is unlocked, as systemd does: a taker
			// that opened the old file finds it unlinked once it locks it.
			if d, err := u.openLockDir(); err == nil {
				unix.Unlinkat(int(d.Fd()), strconv.Itoa(id), 0)
				d.Close()
			}
			lock.Close()
		}
		return privsep.Identity{UID: id, GID: gid}, release, nil
	}
	return privsep.Identity{}, nil, fmt.Errorf("no free id in %d–%d for the worker of domain %s", dynamicFirst, dynamicLast, domain)
}

// openLockDir returns lockDir open, made (0755, root's, as systemd makes
// it) where missing. It refuses a path on which someone other than root
// could replace a component, or a directory others can write.
func (u *dynamicUsers) openLockDir() (*os.File, error) {
	d, _, err := fsutil.MakeDir(u.lockDir, 0o755, 0, 0)
	if err != nil {
		return nil, fmt.Errorf("the dynamic ids' lock directory: %w", err)
	}
	exposed, err := fsutil.Exposures(filepath.Join(u.lockDir, "0"))
	if err == nil && len(exposed) > 0 {
		err = fmt.Errorf("%w: %v", fsutil.ErrNotPrivate, exposed[0])
	}
	if err != nil {
		d.Close()
		return nil, fmt.Errorf("the dynamic ids' lock directory %s: %w", u.lockDir, err)
	}
	return d, nil
}

// lockID opens and locks dir's file for id (created 0600, never through
// a symlink), with systemd's protocol: an exclusive flock(2), then a check
// that the file is still linked. It returns nil, nil when another process
// holds the lock, and the file, holding the lock, otherwise.
func lockID(dir *os.File, id int) (*os.File, error) {
	name := strconv.Itoa(id)
	for {
		fd, err := unix.Openat(int(dir.Fd()), name, unix.O_CREAT|unix.O_RDWR|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("the lock of dynamic id %d: %w", id, err)
		}
		f := os.NewFile(uintptr(fd), filepath.Join(dir.Name(), name))
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Uid != 0 {
			f.Close()
			return nil, fmt.Errorf("the lock of dynamic id %d: %s is not a regular file of root's", id, f.Name())
		}
		if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, nil
			}
			return nil, fmt.Errorf("the lock of dynamic id %d: %w", id, err)
		}
		if err := unix.Fstat(fd, &st); err != nil {
			f.Close()
			return nil, err
		}
		if st.Nlink == 0 {
			// Unlinked by its last holder between the open and the lock.
			f.Close()
			continue
		}
		// What systemd writes there: the name of the id's user.
		if err := f.Truncate(0); err == nil {
			f.WriteAt([]byte("kvmount-worker\n"), 0)
		}
		return f, nil
	}
}

// known reports whether a user or group has id in the user database.
func known(id int) bool {
	s := strconv.Itoa(id)
	if _, err := user.LookupId(s); err == nil {
		return true
	}
	_, err := user.LookupGroupId(s)
	return err == nil
}

// dynamicStart returns where the search for a free dynamic id begins for
// the monitor of process pid: a place of its own in the range, so that
// monitors that start at once — a package upgrade on a host of several
// instances, a thousand on one test machine — do not all contend for the
// first ids' locks.
func dynamicStart(pid int) int {
	return dynamicFirst + pid%(dynamicLast-dynamicFirst+1)
}

// runningIDs returns every user and group id (real, effective, saved,
// file system) of the processes /proc shows now.
func runningIDs() map[int]bool {
	ids := map[int]bool{}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return ids
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue // gone meanwhile
		}
		for _, line := range strings.Split(string(data), "\n") {
			if !strings.HasPrefix(line, "Uid:") && !strings.HasPrefix(line, "Gid:") {
				continue
			}
			for _, f := range strings.Fields(line)[1:] {
				if n, err := strconv.Atoi(f); err == nil {
					ids[n] = true
				}
			}
		}
	}
	return ids
}
