package privsep

import (
	"fmt"
	"runtime"
	"strings"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/sys/unix"
)

// The worker's system call filter is an allowlist, as OpenSSH's
// sandbox-seccomp-filter.c and Chromium's sandbox are: the system calls a
// worker makes — Go's runtime, its net, os and crypto packages, and
// glibc's threads and resolver where the binary links it (cgo, the race
// detector) — and nothing else. Every other one, and every system call of
// another architecture (an amd64 worker's int 0x80 entry, its x32 ABI),
// fails with EPERM (ENOSYS for x32). Some are allowed only with the
// arguments a worker uses:
//
//   - clone only for a thread (CLONE_THREAD, CLONE_VM and CLONE_SIGHAND set,
//     no namespace flag): the worker can make no process. clone3, whose
//     flags a filter cannot see, is ENOSYS, so that glibc falls back to
//     clone; fork, vfork, execve, execveat and memfd_create are refused;
//   - socket only for what the policy needs: TCP (protocol 0 or
//     IPPROTO_TCP, never IPPROTO_MPTCP) over IPv4 and IPv6 when it
//     connects to a TCP port, UDP when it resolves host names, AF_UNIX
//     stream sockets when it connects to unix sockets — and never another
//     family (netlink, packet, vsock, …). bind, listen and accept are
//     refused: the worker only connects;
//   - ioctl only FIONREAD (glibc's resolver sizes an answer with it);
//   - prctl only PR_SET_VMA (Go's runtime names its mappings): no way back
//     to being dumpable, no new seccomp mode;
//   - prlimit64 only on itself (pid 0): prlimit(2) reaches any process of
//     the same user — another trust domain's worker — whose limits it
//     could lower.
//
// kill, setsid, setpgid, ptrace and the rest of what could reach another
// process are not on the list; Landlock's scopes (ABI 6) refuse signals
// and abstract unix sockets outside the worker too.

// workerSyscalls are the system calls a confined worker may make without
// conditions, of every architecture; filterFor keeps those the running
// one has.
var workerSyscalls = []string{
	// Memory.
	"brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "membarrier",
	// Threads, scheduling, signals within the process, time.
	"futex", "sched_yield", "sched_getaffinity", "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres",
	"gettimeofday", "time", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "gettid", "getpid",
	"tgkill", "tkill", "set_robust_list", "rseq", "set_tid_address", "restart_syscall", "exit", "exit_group",
	// Who and what it is.
	"getuid", "geteuid", "getgid", "getegid", "getppid", "getrlimit", "uname", "sysinfo", "getrandom",
	// Files: Landlock decides which may be read, and none written.
	"read", "write", "readv", "writev", "pread64", "close", "close_range", "openat", "open", "fstat", "newfstatat",
	"stat", "lstat", "statx", "lseek", "fcntl", "getdents64", "readlinkat", "readlink", "faccessat", "faccessat2",
	"access", "dup", "dup3",
	// Waiting for descriptors.
	"epoll_create1", "epoll_ctl", "epoll_pwait", "epoll_pwait2", "epoll_wait", "eventfd2", "pipe2", "poll", "ppoll",
	// Sockets once made: Landlock decides where they may connect.
	"connect", "getsockname", "getpeername", "getsockopt", "setsockopt", "sendto", "recvfrom", "sendmsg",
	"recvmsg", "sendmmsg", "recvmmsg", "shutdown",
}

// Arguments the filter compares.
const (
	// threadFlags must all be set in clone's flags: a thread shares its
	// process's memory and signal handlers.
	threadFlags = unix.CLONE_THREAD | unix.CLONE_VM | unix.CLONE_SIGHAND
	// sockFlags are the flags Go and glibc add to every socket's type.
	sockFlags = unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC
	// prSetVMA is prctl's PR_SET_VMA ("SVMA").
	prSetVMA = 0x53564d41
)

// filterFor returns the allowlist filter of a worker confined to p: see
// the comment above workerSyscalls.
func filterFor(p Policy) (seccomp.Filter, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return seccomp.Filter{}, err
	}
	var names []string
	for _, name := range workerSyscalls {
		if _, ok := info.SyscallNames[name]; ok {
			names = append(names, name)
		}
	}
	groups := []seccomp.SyscallGroup{
		{Action: seccomp.ActionAllow, Names: names},
		{Action: seccomp.ActionAllow, NamesWithCondtions: conditionalSyscalls(p)},
		// clone3's flags are behind a pointer: "not implemented", and
		// glibc's pthread_create falls back to clone.
		{Action: seccomp.ActionErrno | seccomp.Action(unix.ENOSYS), Names: []string{"clone3"}},
	}
	return seccomp.Filter{
		NoNewPrivs: true,
		Flag:       seccomp.FilterFlagTSync,
		Policy:     seccomp.Policy{DefaultAction: seccomp.ActionErrno, Syscalls: groups},
	}, nil
}

// conditionalSyscalls returns the system calls allowed only with certain
// arguments, for policy p.
func conditionalSyscalls(p Policy) []seccomp.NameWithConditions {
	var out []seccomp.NameWithConditions
	if runtime.GOARCH == "amd64" || runtime.GOARCH == "arm64" {
		// clone's flags are its first argument here (s390x has them
		// second).
		out = append(out, seccomp.NameWithConditions{Name: "clone", Conditions: seccomp.ArgumentConditions{
			{Argument: 0, Operation: seccomp.BitsSet, Value: threadFlags},
			{Argument: 0, Operation: seccomp.BitsNotSet, Value: namespaceFlags},
		}})
	}
	socket := func(family, typ, protocol uint64) {
		out = append(out, seccomp.NameWithConditions{Name: "socket", Conditions: seccomp.ArgumentConditions{
			{Argument: 0, Operation: seccomp.Equal, Value: family},
			{Argument: 1, Operation: seccomp.Equal, Value: typ | sockFlags},
			{Argument: 2, Operation: seccomp.Equal, Value: protocol},
		}})
	}
	for _, family := range []uint64{unix.AF_INET, unix.AF_INET6} {
		if len(p.ConnectTCP) > 0 {
			socket(family, unix.SOCK_STREAM, 0)
			socket(family, unix.SOCK_STREAM, unix.IPPROTO_TCP)
		}
		if len(p.SendUDP) > 0 {
			socket(family, unix.SOCK_DGRAM, 0)
			socket(family, unix.SOCK_DGRAM, unix.IPPROTO_UDP)
		}
	}
	if len(p.UnixSockets) > 0 {
		socket(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	}
	out = append(out,
		seccomp.NameWithConditions{Name: "ioctl", Conditions: seccomp.ArgumentConditions{
			{Argument: 1, Operation: seccomp.Equal, Value: unix.TIOCINQ}, // FIONREAD
		}},
		seccomp.NameWithConditions{Name: "prctl", Conditions: seccomp.ArgumentConditions{
			{Argument: 0, Operation: seccomp.Equal, Value: prSetVMA},
		}},
		// prlimit64 on itself alone (pid 0, as Go and glibc call it):
		// prlimit(2) on another process needs only the same user, and
		// the workers of a daemon's other trust domains are its user's.
		seccomp.NameWithConditions{Name: "prlimit64", Conditions: seccomp.ArgumentConditions{
			{Argument: 0, Operation: seccomp.Equal, Value: 0},
		}},
	)
	return out
}

// namespaceFlags are clone(2)'s flags that make a new namespace.
// (CLONE_NEWTIME is only clone3's and unshare's: in clone's flags its bit
// is part of the exit signal.)
const namespaceFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
	unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET

// InForce says, a line each, what confines a worker of policy p on a
// kernel that offers c (Offered): its seccomp allowlist, its Landlock
// rules by the ABI's reach, and the bounds Harden sets — for kvmount
// check, /status and the log, so that an operator reads what holds on
// this host, not what the code could do on another.
func InForce(c Confinement, p Policy) []string {
	var out []string
	if c.Seccomp {
		f, err := filterFor(p)
		n := 0
		if err == nil {
			n = len(f.Policy.Syscalls[0].Names)
		}
		var sockets []string
		if len(p.ConnectTCP) > 0 {
			sockets = append(sockets, "TCP (IPv4, IPv6; no MPTCP)")
		}
		if len(p.SendUDP) > 0 {
			sockets = append(sockets, "UDP (for DNS)")
		}
		if len(p.UnixSockets) > 0 {
			sockets = append(sockets, "unix stream")
		}
		if len(sockets) == 0 {
			sockets = append(sockets, "none")
		}
		out = append(out, fmt.Sprintf("seccomp: an allowlist of %d system calls of %s and a few with checked arguments; every other, and every other architecture's (the i386 entry), refused; threads only (no fork, exec or memfd); sockets: %s; no bind, listen or accept",
			n, runtime.GOARCH, strings.Join(sockets, ", ")))
	} else {
		out = append(out, "seccomp: none (the kernel has no seccomp filters)")
	}
	switch {
	case c.LandlockABI == 0:
		out = append(out, "Landlock: none (the kernel offers none): the worker reads what its user may, and connects anywhere")
	default:
		line := fmt.Sprintf("Landlock ABI %d: reads only the resolver's files and the CA certificates, writes nothing", c.LandlockABI)
		if c.LandlockABI >= 4 {
			line += fmt.Sprintf("; connects over TCP only to ports %v", p.ConnectTCP)
		}
		if c.LandlockABI >= 6 {
			line += "; signals and abstract unix sockets only within the worker"
		}
		out = append(out, line)
	}
	return append(out, fmt.Sprintf("process: no capability, no_new_privs, not dumpable, no core dumps, at most %d tasks of its user, inherited descriptors closed, ended with its process group", MaxWorkerTasks))
}
