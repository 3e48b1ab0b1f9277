package privsep

import (
	"fmt"

	seccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/landlock-lsm/go-landlock/landlock"
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
// best effort: what the kernel's ABI offers) limits it to p — files, TCP
// and UDP ports, unix sockets, and from ABI 6 the scopes of signals and
// abstract unix sockets —, and a seccomp filter
// (github.com/elastic/go-seccomp-bpf, with TSYNC) allows only the system
// calls and arguments of sandbox.go's allowlist for p, refusing every other
// one and every other architecture's with EPERM. It sets no_new_privs,
// which both need. A worker calls it before it reads anything from
// outside.
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
	filter, err := filterFor(p)
	if err != nil {
		return c, fmt.Errorf("privsep: the seccomp filter: %w", err)
	}
	if err := seccomp.LoadFilter(filter); err != nil {
		return c, fmt.Errorf("privsep: loading the seccomp filter: %w", err)
	}
	c.Seccomp = true
	return c, nil
}
