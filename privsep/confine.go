package privsep

import (
	"fmt"
	"runtime"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/landlock-lsm/go-landlock/landlock"
	"golang.org/x/sys/unix"
)

// Policy is what a confined worker may still reach.
type Policy struct {
	// ReadFiles and ReadDirs are the files and directory trees it may
	// read, such as /etc/resolv.conf, /etc/hosts and /etc/nsswitch.conf
	// for name resolution, and the system's CA certificates; a path that
	// does not exist is left out. Nothing else of the file system can be
	// read, and nothing written.
	ReadFiles, ReadDirs []string
	// ConnectTCP are the TCP ports it may connect to (the sources'); a
	// connection to any other port is refused (EACCES) from Landlock ABI
	// 4 on.
	ConnectTCP []uint16
	// SendUDP are the UDP ports it may send to (53, for DNS), where the
	// kernel's Landlock controls UDP.
	SendUDP []uint16
	// UnixSockets are the unix sockets it may connect to (etcd's
	// unix:// endpoints), where the kernel's Landlock controls that
	// (LANDLOCK_ACCESS_FS_RESOLVE_UNIX); before, any pathname socket the
	// worker's user may reach.
	UnixSockets []string
}

// Confinement tells what Confine applied, for kvmount check and /status.
type Confinement struct {
	// LandlockABI is the Landlock ABI the kernel offers, 0 for none
	// (kernels before 5.13, or Landlock not enabled). From 1, the file
	// system outside the policy is refused; from 4, TCP ports; from 6,
	// signals to and abstract unix sockets of processes outside the
	// worker.
	LandlockABI int
	// Seccomp reports whether the system call filter is loaded.
	Seccomp bool
}

// Confine narrows what the calling process may do, on all its threads and
// for good: a Landlock ruleset (through github.com/landlock-lsm/go-landlock,
// best effort: what the kernel's ABI offers) limits it to p, and a seccomp
// filter (github.com/elastic/go-seccomp-bpf, with TSYNC) refuses with
// EPERM the system calls in deniedSyscalls, and clone with a namespace
// flag. It sets no_new_privs, which both need. A worker calls it before
// it reads anything from outside.
//
// Without Landlock or seccomp in the kernel, Confine applies what there
// is and says so in its result; it returns an error only when a facility
// the kernel offers fails.
func Confine(p Policy) (Confinement, error) {
	c := Confinement{LandlockABI: Offered().LandlockABI}
	rules := []landlock.Rule{
		landlock.ROFiles(p.ReadFiles...).IgnoreIfMissing(),
		landlock.RODirs(p.ReadDirs...).IgnoreIfMissing(),
	}
	if len(p.UnixSockets) > 0 {
		rules = append(rules, landlock.ROFiles(p.UnixSockets...).WithResolveUnix().IgnoreIfMissing())
	}
	for _, port := range p.ConnectTCP {
		rules = append(rules, landlock.ConnectTCP(port))
	}
	for _, port := range p.SendUDP {
		rules = append(rules, landlock.ConnectSendUDP(port))
	}
	if err := landlock.V11.BestEffort().Restrict(rules...); err != nil {
		return c, fmt.Errorf("privsep: Landlock (ABI %d): %w", c.LandlockABI, err)
	}
	if !seccomp.Supported() {
		return c, nil
	}
	filter := seccomp.Filter{
		NoNewPrivs: true,
		Flag:       seccomp.FilterFlagTSync,
		Policy: seccomp.Policy{
			DefaultAction: seccomp.ActionAllow,
			Syscalls: []seccomp.SyscallGroup{
				{Action: seccomp.ActionErrno, Names: deniedSyscalls()},
				// clone3 is "not implemented": glibc's pthread_create (a
				// cgo program's threads) falls back to clone then, and
				// fails on EPERM.
				{Action: seccomp.ActionErrno | seccomp.Action(unix.ENOSYS), Names: []string{"clone3"}},
				// clone with a namespace flag: a new thread or process of
				// its own is all the worker may make.
				{Action: seccomp.ActionErrno, NamesWithCondtions: cloneNamespaces()},
			},
		},
	}
	if err := seccomp.LoadFilter(filter); err != nil {
		return c, fmt.Errorf("privsep: loading the seccomp filter: %w", err)
	}
	c.Seccomp = true
	return c, nil
}

// namespaceFlags are clone(2)'s flags that make a new namespace.
// (CLONE_NEWTIME is only clone3's and unshare's: in clone's flags its bit
// is part of the exit signal.)
const namespaceFlags = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
	unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET

// cloneNamespaces is the rule that refuses clone with any of
// namespaceFlags, where clone's flags are its first argument (amd64,
// arm64; s390x has them second); elsewhere none.
func cloneNamespaces() []seccomp.NameWithConditions {
	if runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64" {
		return nil
	}
	return []seccomp.NameWithConditions{{Name: "clone", Conditions: seccomp.ArgumentConditions{
		{Argument: 0, Operation: seccomp.BitsSet, Value: namespaceFlags},
	}}}
}

// deniedSyscalls are the system calls a worker never makes, refused with
// EPERM (and clone3, whose namespace flags clone's filter cannot see, with
// ENOSYS): mounting and namespaces, tracing and reading other processes'
// memory, changing its identity or files' owners, executing a program,
// loading kernel code or BPF, io_uring (which bypasses this filter), and
// the host's clocks, keys, swap and reboot. Go's runtime and net package
// need none of them.
func deniedSyscalls() []string {
	return append([]string{
		"mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig", "fspick",
		"move_mount", "open_tree", "mount_setattr", "unshare", "setns",
		"ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
		"setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid",
		"setgroups", "capset", "fchown", "fchownat", "mknodat",
		"execve", "execveat",
		"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "bpf",
		"perf_event_open", "userfaultfd", "open_by_handle_at", "name_to_handle_at",
		"io_uring_setup", "io_uring_enter", "io_uring_register",
		"keyctl", "add_key", "request_key", "acct", "quotactl", "swapon", "swapoff", "reboot",
		"settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "syslog", "sethostname", "setdomainname", "vhangup",
	}, archDeniedSyscalls...)
}
