package escapetest

import (
	"golang.org/x/sys/unix"
)

func int80(trap, a1, a2, a3 uintptr) uintptr

// i386 system call numbers (arch/x86/entry/syscalls/syscall_32.tbl).
const (
	i386Fork         = 2
	i386Clone        = 120
	i386Keyctl       = 288
	i386IoUringSetup = 425
)

// i386Call makes a system call through the i386 entry and returns its
// error (nil for success); a process it made is waited for.
func i386Call(trap, a1, a2, a3 uintptr) error {
	r := int80(trap, a1, a2, a3)
	if int32(r) < 0 && int32(r) > -4096 {
		return unix.Errno(-int32(r))
	}
	if (trap == i386Clone || trap == i386Fork) && r > 0 {
		_, _ = unix.Wait4(int(r), nil, 0, nil)
	}
	return nil
}

// i386Attempts are the ways out through the i386 entry of an amd64
// process, which a filter that checks only the native architecture lets
// through: a child in a new user and network namespace, a kernel keyring,
// io_uring (which bypasses the filter), and a plain fork.
func i386Attempts() map[string]func() error {
	return map[string]func() error{
		"i386 clone user": func() error {
			return i386Call(i386Clone, unix.CLONE_NEWUSER|unix.CLONE_NEWNET|uintptr(unix.SIGCHLD), 0, 0)
		},
		"i386 keyctl": func() error {
			return i386Call(i386Keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, ^uintptr(0)-2 /* KEY_SPEC_SESSION_KEYRING, -3 */, 0)
		},
		"i386 io_uring_setup":   func() error { return i386Call(i386IoUringSetup, 1, 0, 0) },
		"i386 fork":             func() error { return i386Call(i386Fork, 0, 0, 0) },
		"native io_uring_setup": func() error { return ioUringSetup() },
	}
}
