package privsep

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	seccomp "github.com/elastic/go-seccomp-bpf"
	llsyscall "github.com/landlock-lsm/go-landlock/landlock/syscall"
	"golang.org/x/sys/unix"
)

// Offered returns what Confine can apply on this kernel: the Landlock ABI
// it offers (0 for none) and whether it has seccomp filters. The monitor
// asks, for kvmount check and /status; the worker's Confine applies
// exactly this, best effort, on the same kernel.
func Offered() Confinement {
	var c Confinement
	if abi, err := llsyscall.LandlockGetABIVersion(); err == nil {
		c.LandlockABI = abi
	}
	c.Seccomp = seccomp.Supported()
	return c
}

// Observed is a process as the kernel shows it in /proc/PID/status
// (proc(5)): not what the process says of itself.
type Observed struct {
	// UIDs are its real, effective, saved and file system user ids.
	UIDs [4]int
	// CapEff, CapPrm and CapBnd are its effective, permitted and bounding
	// capability sets, as bit masks.
	CapEff, CapPrm, CapBnd uint64
	// NoNewPrivs is its no_new_privs bit (prctl(2)).
	NoNewPrivs bool
	// Seccomp is its seccomp mode: 0 none, 1 strict, 2 a filter.
	Seccomp int
}

// maxProcStatus bounds the read of /proc/PID/status, in bytes (a few KiB
// in practice).
const maxProcStatus = 64 << 10

// Observe returns what the kernel shows of process pid. It returns an
// error when the process is gone, or its status lacks a field. A pid is
// given again once its process has been waited for: see
// Supervisor.ObserveWorker for the worker's.
func Observe(pid int) (Observed, error) {
	var o Observed
	f, err := os.OpenFile("/proc/"+strconv.Itoa(pid)+"/status", os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		return o, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return o, fmt.Errorf("privsep: /proc/%d/status is not procfs' regular file", pid)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxProcStatus))
	if err != nil {
		return o, fmt.Errorf("privsep: /proc/%d/status: %w", pid, err)
	}
	seen := 0
	for line := range bytes.SplitSeq(data, []byte("\n")) {
		k, v, ok := strings.Cut(string(line), ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Uid":
			ids := strings.Fields(v)
			if len(ids) != 4 {
				return o, fmt.Errorf("privsep: /proc/%d/status: Uid %q", pid, v)
			}
			for i, id := range ids {
				if o.UIDs[i], err = strconv.Atoi(id); err != nil {
					return o, fmt.Errorf("privsep: /proc/%d/status: Uid %q", pid, v)
				}
			}
		case "CapEff", "CapPrm", "CapBnd":
			mask, err := strconv.ParseUint(v, 16, 64)
			if err != nil {
				return o, fmt.Errorf("privsep: /proc/%d/status: %s %q", pid, k, v)
			}
			switch k {
			case "CapEff":
				o.CapEff = mask
			case "CapPrm":
				o.CapPrm = mask
			default:
				o.CapBnd = mask
			}
		case "NoNewPrivs":
			o.NoNewPrivs = v == "1"
		case "Seccomp":
			if o.Seccomp, err = strconv.Atoi(v); err != nil {
				return o, fmt.Errorf("privsep: /proc/%d/status: Seccomp %q", pid, v)
			}
		default:
			continue
		}
		seen++
	}
	if seen != 6 {
		return o, fmt.Errorf("privsep: /proc/%d/status lacks a field of Uid, CapEff, CapPrm, CapBnd, NoNewPrivs, Seccomp", pid)
	}
	return o, nil
}
