// Package escapetest holds what the tests make a compromised worker try:
// each way out of its confinement that issue 28 names, and a few more.
// Only tests import it.
package escapetest

import (
	"net"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Attempts returns, by name, what a compromised worker would try: read
// /etc/shadow, create a file under /root and under /tmp, mount a tmpfs,
// signal PID 1, ptrace the monitor (pid monitor), make a user namespace
// (unshare, and a child in one: clone), execute a program, change its
// user ids, connect to other, a TCP address its policy does not allow;
// fork, make an executable memory file, leave its session, become
// dumpable again, open an MPTCP, UDP, unix, vsock or netlink socket,
// listen, set up io_uring — and on amd64 the same through the i386 entry
// (int $0x80): a child in new namespaces, a keyring, io_uring, a fork.
// Each returns nil when it succeeded, and removes what it made.
func Attempts(monitor int, other string) map[string]func() error {
	attempts := map[string]func() error{
		"open /etc/shadow":  func() error { return CloseAfter(os.Open("/etc/shadow")) },
		"write under /root": func() error { return create("/root") },
		"write under /tmp":  func() error { return create("/tmp") },
		"mount":             func() error { return unix.Mount("tmpfs", os.TempDir(), "tmpfs", 0, "") },
		"kill 1":            func() error { return unix.Kill(1, 0) },
		"ptrace":            func() error { return unix.PtraceAttach(monitor) },
		"unshare user":      func() error { return unix.Unshare(unix.CLONE_NEWUSER) },
		"clone user":        cloneUser,
		"execve": func() error {
			// A plain fork and exec: os/exec would open /dev/null first.
			pid, err := syscall.ForkExec("/bin/true", []string{"true"}, &syscall.ProcAttr{Dir: "/"})
			if err == nil {
				_, err = syscall.Wait4(pid, nil, 0, nil)
			}
			return err
		},
		"setresuid": func() error {
			// Keeping every id (-1) is a no-op any process may ask for.
			const keep = uintptr(0xffffffff)
			if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, keep, keep); e != 0 {
				return e
			}
			return nil
		},
		"connect other": func() error { return CloseAfter(net.Dial("tcp", other)) },
		"fork": func() error {
			pid, _, errno := unix.RawSyscall6(unix.SYS_CLONE, uintptr(unix.SIGCHLD), 0, 0, 0, 0, 0)
			if errno != 0 {
				return errno
			}
			if pid == 0 {
				unix.RawSyscall(unix.SYS_EXIT_GROUP, 0, 0, 0)
			}
			_, err := unix.Wait4(int(pid), nil, 0, nil)
			return err
		},
		"memfd_create": func() error {
			fd, err := unix.MemfdCreate("kvmount-escape", 0)
			if err == nil {
				unix.Close(fd)
			}
			return err
		},
		"setsid":       func() error { _, err := unix.Setsid(); return err },
		"dumpable":     func() error { return unix.Prctl(unix.PR_SET_DUMPABLE, 1, 0, 0, 0) },
		"mptcp socket": func() error { return socket(unix.AF_INET, unix.SOCK_STREAM, 262 /* IPPROTO_MPTCP */) },
		"udp socket":   func() error { return socket(unix.AF_INET, unix.SOCK_DGRAM, 0) },
		"unix socket":  func() error { return socket(unix.AF_UNIX, unix.SOCK_STREAM, 0) },
		"vsock socket": func() error { return socket(unix.AF_VSOCK, unix.SOCK_STREAM, 0) },
		"netlink socket": func() error {
			return socket(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE)
		},
		"listen": func() error {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
				return err
			}
			return unix.Listen(fd, 1)
		},
	}
	for name, try := range i386Attempts() {
		attempts[name] = try
	}
	return attempts
}

// socket makes a socket of family, type (with Go's flags) and protocol,
// and closes it.
func socket(family, typ, protocol int) error {
	fd, err := unix.Socket(family, typ|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, protocol)
	if err == nil {
		unix.Close(fd)
	}
	return err
}

// ioUringSetup asks for an io_uring, which a filter cannot see into.
func ioUringSetup() error {
	var params [120]byte
	fd, _, errno := unix.RawSyscall(unix.SYS_IO_URING_SETUP, 1, uintptr(unsafe.Pointer(&params[0])), 0)
	if errno != 0 {
		return errno
	}
	unix.Close(int(fd))
	return nil
}

// Refusals are the errors a worker confined by privsep.Confine gets for
// each of Attempts: EACCES from Landlock, EPERM from seccomp or from its
// lack of capabilities.
var Refusals = map[string]error{
	"open /etc/shadow":  unix.EACCES,
	"write under /root": unix.EACCES,
	"write under /tmp":  unix.EACCES, // Landlock
	"mount":             unix.EPERM,
	"kill 1":            unix.EPERM,
	"ptrace":            unix.EPERM,
	"unshare user":      unix.EPERM, // seccomp
	"clone user":        unix.EPERM, // seccomp
	"execve":            unix.EPERM, // seccomp
	"setresuid":         unix.EPERM, // seccomp
	"connect other":     unix.EACCES,
	// The allowlist (issue 36): seccomp's EPERM for each, the i386 entry
	// included.
	"fork":                  unix.EPERM,
	"memfd_create":          unix.EPERM,
	"setsid":                unix.EPERM,
	"dumpable":              unix.EPERM,
	"mptcp socket":          unix.EPERM,
	"udp socket":            unix.EPERM,
	"unix socket":           unix.EPERM,
	"vsock socket":          unix.EPERM,
	"netlink socket":        unix.EPERM,
	"listen":                unix.EPERM,
	"native io_uring_setup": unix.EPERM,
}

func init() {
	for name := range i386Attempts() {
		Refusals[name] = unix.EPERM // seccomp: another architecture's entry
	}
}

// Run runs attempts and returns each one's error, "" for none.
func Run(attempts map[string]func() error) map[string]string {
	out := make(map[string]string, len(attempts))
	for name, try := range attempts {
		out[name] = ""
		if err := try(); err != nil {
			out[name] = err.Error()
		}
	}
	return out
}

// cloneUser forks a child in a new user namespace, the legacy clone(2)
// way, which exits at once, and waits for it.
func cloneUser() error {
	pid, _, errno := unix.RawSyscall6(unix.SYS_CLONE, unix.CLONE_NEWUSER|uintptr(unix.SIGCHLD), 0, 0, 0, 0, 0)
	if errno != 0 {
		return errno
	}
	if pid == 0 {
		// The child: a copy of this process with one thread, which must
		// not run Go code.
		unix.RawSyscall(unix.SYS_EXIT_GROUP, 0, 0, 0)
	}
	_, err := unix.Wait4(int(pid), nil, 0, nil)
	return err
}

// create makes a file in dir and removes it.
func create(dir string) error {
	f, err := os.CreateTemp(dir, "kvmount-escape-*")
	if err == nil {
		f.Close()
		os.Remove(f.Name())
	}
	return err
}

// CloseAfter closes what an open or dial returned, and returns its error.
func CloseAfter[T interface{ Close() error }](v T, err error) error {
	if err == nil {
		v.Close()
	}
	return err
}
