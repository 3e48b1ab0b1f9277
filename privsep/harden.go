package privsep

import (
	"errors"
	"fmt"
	"math"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// Bounds of a worker's own process, set by Harden.
const (
	// MaxWorkerTasks is the worker user's RLIMIT_NPROC: the threads of
	// its workers (Go's runtime makes a few dozen); it can fork none
	// (sandbox.go), and this bounds what a kernel without seccomp would
	// let it make.
	MaxWorkerTasks = 1024
)

// Harden is the first thing a worker does: every descriptor above keep
// that it inherited is closed — one its parent held without
// close-on-exec, a root-only file, is never the worker's (sshd's
// closefrom) —, the process
// is made not dumpable, so that another process of its user can neither
// read its memory (/proc/PID/mem, ptrace) nor make it dump core, and its
// core size and task count are bounded (RLIMIT_CORE 0, RLIMIT_NPROC
// MaxWorkerTasks; prctl(2), getrlimit(2)). It returns the first error.
func Harden(keep int) error {
	if err := closeInherited(keep); err != nil {
		return fmt.Errorf("privsep: closing inherited descriptors: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("privsep: PR_SET_DUMPABLE: %w", err)
	}
	if err := unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{}); err != nil {
		return fmt.Errorf("privsep: RLIMIT_CORE: %w", err)
	}
	if err := unix.Setrlimit(unix.RLIMIT_NPROC, &unix.Rlimit{Cur: MaxWorkerTasks, Max: MaxWorkerTasks}); err != nil {
		return fmt.Errorf("privsep: RLIMIT_NPROC: %w", err)
	}
	return nil
}

// MarkInheritedCloseOnExec sets close-on-exec on every descriptor above
// stderr: what the monitor's parent handed down (a root-only file left
// open) reaches neither the worker nor a command kvmount starts. kvmount's
// main calls it first.
func MarkInheritedCloseOnExec() error {
	setCloexec := func(fd int) error {
		_, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, unix.FD_CLOEXEC)
		return err
	}
	if err := eachInherited(2, setCloexec, func() error { return unix.CloseRange(3, math.MaxUint32, unix.CLOSE_RANGE_CLOEXEC) }); err != nil {
		return fmt.Errorf("privsep: marking inherited descriptors close-on-exec: %w", err)
	}
	return nil
}

// closeInherited closes every descriptor above keep that came through the
// exec: those without close-on-exec. The descriptors the process opened
// itself since — the Go runtime's poller, made before main may run — are
// all close-on-exec, and stay.
func closeInherited(keep int) error {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err
	}
	for _, e := range entries {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || fd <= keep {
			continue
		}
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC != 0 {
			continue // gone (the directory's own), or the process's own
		}
		if err := unix.Close(fd); err != nil && !errors.Is(err, unix.EBADF) {
			return err
		}
	}
	return nil
}

// eachInherited runs ranged (close_range(2), Linux 5.9, with
// CLOSE_RANGE_CLOEXEC 5.11) or, on a kernel without it, do on each
// descriptor above keep that /proc/self/fd lists.
func eachInherited(keep int, do func(fd int) error, ranged func() error) error {
	err := ranged()
	if err == nil || !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.EINVAL) {
		return err
	}
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err
	}
	for _, e := range entries {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || fd <= keep {
			continue
		}
		if err := do(fd); err != nil && !errors.Is(err, unix.EBADF) {
			return err
		}
	}
	return nil
}
