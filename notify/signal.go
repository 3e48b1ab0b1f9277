package notify

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/fsutil"
)

// pidFileLimit is the most bytes read from a PID file: a PID and a newline
// take at most 11 (PID_MAX_LIMIT is 2^22). systemd reads one line of at
// most LINE_MAX; kvmount reads less, and a larger file is refused.
const pidFileLimit = 32

// cgroupFileLimit bounds what is read of /proc/PID/cgroup.
const cgroupFileLimit = 64 << 10

// readPIDFile reads the PID a signal entry's pid_file names, the way
// systemd reads a unit's PIDFile= (src/core/service.c,
// service_load_pid_file): the file is opened without following a symlink in
// any component and without blocking (a FIFO would hang the read), must be
// a regular file, and is read up to pidFileLimit bytes; its content is
// never quoted in an error, since whoever writes it could make kvmount
// print any file's content in its log and on /status. A file with more
// than one link is refused too: with a hard link, anyone could place a
// root-owned file of another service at the path. It returns the PID and
// the file's owner.
func readPIDFile(path string) (pid int, owner uint32, err error) {
	f, err := fsutil.OpenNoFollow(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY)
	if err != nil {
		var perr *fs.PathError
		if errors.As(err, &perr) {
			err = perr.Err
		}
		return 0, 0, fmt.Errorf("pid_file %s: %w", path, err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, 0, fmt.Errorf("pid_file %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, 0, fmt.Errorf("pid_file %s is not a regular file", path)
	}
	data, err := io.ReadAll(io.LimitReader(f, pidFileLimit+1))
	if err != nil {
		return 0, 0, fmt.Errorf("pid_file %s: %w", path, err)
	}
	if len(data) > pidFileLimit {
		return 0, 0, fmt.Errorf("pid_file %s holds more than %d bytes: not a PID file", path, pidFileLimit)
	}
	pid, err = strconv.Atoi(string(bytes.TrimSpace(data)))
	if err != nil || pid <= 0 {
		return 0, 0, fmt.Errorf("pid_file %s does not hold a process ID", path)
	}
	owner = st.Uid
	if st.Nlink > 1 {
		// A hard link made elsewhere by someone else: whose it is says
		// nothing of who may have put it there.
		return pid, owner, fmt.Errorf("pid_file %s has %d links; a PID file has one", path, st.Nlink)
	}
	return pid, owner, nil
}

// sendSignal reads the entry's PID file (at each notification: the service
// may have restarted) and signals that process through a pidfd, so that a
// PID reused between the checks and the signal never gets it.
//
// A PID of 1 or below is refused. A PID file that root does not own may
// have been written by anyone who can write it, the service's own user
// included, and could name any process: it is accepted only with a unit
// beside it (unit = "nginx.service") whose control group holds the PID —
// systemd's rule for PIDFile= — and otherwise refused with an error that
// says so. With a unit, the check applies to a root-owned file too.
func (n *Notifier) sendSignal(ctx context.Context, e config.Notify) error {
	sig := unix.SignalName(e.Signal)
	pid, owner, err := readPIDFile(e.PIDFile)
	if err != nil {
		return fmt.Errorf("signal %s: %w", sig, err)
	}
	if pid <= 1 {
		return fmt.Errorf("signal %s: pid_file %s names PID %d; refusing to signal it", sig, e.PIDFile, pid)
	}
	if owner != 0 && e.PIDUnit == "" {
		return fmt.Errorf("signal %s: pid_file %s is owned by uid %d, not root, so its PID cannot be trusted; name the unit whose process it is (unit = \"nginx.service\"), or notify with systemd_unit", sig, e.PIDFile, owner)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("signal %s: process %d (from %s) is not running", sig, pid, e.PIDFile)
	}
	if err != nil {
		return fmt.Errorf("signal %s: process %d (from %s): %w", sig, pid, e.PIDFile, err)
	}
	defer unix.Close(pidfd)
	if e.PIDUnit != "" {
		if err := n.inUnit(ctx, pid, e.PIDUnit); err != nil {
			return fmt.Errorf("signal %s: process %d (from %s): %w", sig, pid, e.PIDFile, err)
		}
	}
	if err := unix.PidfdSendSignal(pidfd, e.Signal, nil, 0); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("signal %s: process %d (from %s) is not running", sig, pid, e.PIDFile)
		}
		return fmt.Errorf("signal %s: process %d (from %s): %w", sig, pid, e.PIDFile, err)
	}
	return nil
}

// inUnit returns nil when process pid belongs to unit's control group or
// one below it, as systemd asks of a PID file not owned by root.
func (n *Notifier) inUnit(ctx context.Context, pid int, unit string) error {
	conn, err := n.opts.SystemdConn.Connect(ctx)
	if err != nil {
		return fmt.Errorf("unit %s: connecting to systemd over D-Bus: %w", unit, err)
	}
	defer conn.Close()
	cg, err := conn.ControlGroup(ctx, unit)
	if err != nil {
		return fmt.Errorf("unit %s: %w", unit, err)
	}
	if cg == "" {
		return fmt.Errorf("unit %s has no control group: it is not running", unit)
	}
	got, err := processCgroup(pid)
	if err != nil {
		return err
	}
	if got != cg && !strings.HasPrefix(got, strings.TrimSuffix(cg, "/")+"/") {
		return fmt.Errorf("it is not a process of unit %s (its control group is %s, the unit's %s); refusing to signal it", unit, got, cg)
	}
	return nil
}

// processCgroup returns the control group of process pid: its cgroup v2
// path ("0::/system.slice/nginx.service"), or on a legacy hierarchy the
// name=systemd one, which is where systemd keeps units.
func processCgroup(pid int) (string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, cgroupFileLimit))
	if err != nil {
		return "", err
	}
	legacy := ""
	for line := range strings.SplitSeq(string(data), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok && p != "" {
			return p, nil
		}
		if _, p, ok := strings.Cut(line, ":name=systemd:"); ok {
			legacy = p
		}
	}
	if legacy == "" {
		return "", fmt.Errorf("/proc/%d/cgroup names no control group", pid)
	}
	return legacy, nil
}
