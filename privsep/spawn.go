// Package privsep holds kvmount's privilege separation, after OpenSSH's
// (privsep, since 2002): a privileged monitor that keeps what only root
// can do, unprivileged workers — one per trust domain — that read the
// network and store content, and a narrow protocol between them. It is
// the seam's one home; a reader finds here everything a compromised
// worker can make root do:
//
//   - requests.go: what a worker may send, each message with the phase
//     it is allowed in, its budget and what the monitor does with it;
//   - monitor.go and domain.go: the monitor's side — a worker per trust
//     domain, each given its domain's share of the configuration alone;
//     supervise.go runs one (starts, restarts, queues, breaches),
//     assemble.go rebuilds its payloads applying every guard rail again,
//     remote.go is the desired state their reports build;
//   - worker.go: the worker's side — what it sends, its log handler, its
//     requests for credential files;
//   - wire.go and messages.go: the frames and their bounds;
//   - spawn.go, harden.go, confine.go, sandbox.go and policy.go: a worker
//     started with no privilege to lose (another user, no capability,
//     no_new_privs), hardened at its start, and confined by itself before
//     it reads anything from outside — a seccomp allowlist and a Landlock
//     ruleset of its domain's policy;
//   - observe.go: a worker as the kernel shows it in /proc.
package privsep

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"
)

// Identity is the user and group a worker runs as, as numeric ids; it
// runs with no supplementary group.
type Identity struct {
	UID, GID int
}

// Worker is a worker process that Spawn started.
type Worker struct {
	// Process is the running worker.
	Process *os.Process

	done chan struct{}
	err  error
}

// Wait waits for the worker to exit and returns what exec.Cmd.Wait
// returned.
func (w *Worker) Wait() error {
	<-w.done
	return w.err
}

// Done is closed once the worker has exited and been waited for.
func (w *Worker) Done() <-chan struct{} { return w.done }

// Spawn starts cmd as the worker: as id, with no supplementary group, with
// every capability set empty — effective, permitted and ambient (the
// kernel clears them when a root process becomes another user and
// executes a program, capabilities(7)), inheritable and bounding (emptied
// here) — and with no_new_privs, so that nothing the worker executes gains
// a privilege back through a set-user-ID or file-capability program
// (prctl(2), PR_SET_NO_NEW_PRIVS).
//
// Capability sets and no_new_privs belong to a thread, and a child
// inherits those of the thread that forks it. So Spawn empties them on a
// thread of its own, locked to one goroutine and never handed back to the
// Go scheduler, which forks cmd, waits for it, and ends with it; the
// monitor's other threads keep theirs. That thread is never the main one,
// which cannot end and whose sets /proc/PID/status shows for the process. The worker gets SIGKILL if that
// thread ends first — with the monitor (prctl(2), PR_SET_PDEATHSIG).
//
// cmd.SysProcAttr's Credential, AmbientCaps and Pdeathsig are set here.
// Spawn needs CAP_SETPCAP, CAP_SETUID and CAP_SETGID. It returns an error
// for id 0 (root), the error of a prctl or capset that failed (nothing is
// started then), or exec.Cmd.Start's.
func Spawn(cmd *exec.Cmd, id Identity) (*Worker, error) {
	if id.UID == 0 || id.GID == 0 {
		return nil, errors.New("privsep: a worker never runs as root or in root's group")
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(id.UID), Gid: uint32(id.GID), Groups: []uint32{}}
	cmd.SysProcAttr.AmbientCaps = nil
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL

	w := &Worker{done: make(chan struct{})}
	started := make(chan error, 1)
	run := func() {
		// Never unlocked: the thread's capabilities are gone, so it ends
		// with this goroutine instead of running any other.
		runtime.LockOSThread()
		defer close(w.done)
		if err := dropThreadPrivileges(); err != nil {
			started <- err
			return
		}
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		w.Process = cmd.Process
		started <- nil
		w.err = cmd.Wait()
	}
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() != unix.Getpid() {
			run()
			return
		}
		// The main thread: it never ends, and its capabilities are the
		// ones /proc/PID/status shows for the monitor. Hold it, so that
		// the goroutine below gets another thread.
		defer runtime.UnlockOSThread()
		go run()
		<-w.done
	}()
	if err := <-started; err != nil {
		<-w.done
		return nil, err
	}
	return w, nil
}

// dropThreadPrivileges sets no_new_privs and empties the bounding and
// inheritable capability sets of the calling thread.
func dropThreadPrivileges() error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("privsep: setting no_new_privs: %w", err)
	}
	// Every capability up to the kernel's last: PR_CAPBSET_DROP of a
	// number past it fails with EINVAL.
	for c := 0; c < 64; c++ {
		err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0)
		if errors.Is(err, unix.EINVAL) {
			break
		}
		if err != nil {
			return fmt.Errorf("privsep: dropping capability %d from the bounding set: %w", c, err)
		}
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("privsep: reading capabilities: %w", err)
	}
	data[0].Inheritable, data[1].Inheritable = 0, 0
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("privsep: emptying the inheritable capabilities: %w", err)
	}
	return nil
}
