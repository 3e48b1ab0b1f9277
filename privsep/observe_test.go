package privsep

import (
	"os"
	"os/exec"
	"strconv"
	"testing"
)

// TestObserve: Observe reads the fields of /proc/PID/status as they are,
// and fails for a process that is gone.
func TestObserve(t *testing.T) {
	o, err := Observe(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	status := procStatus(t, os.Getpid())
	if o.UIDs[0] != os.Getuid() || o.UIDs[1] != os.Geteuid() {
		t.Errorf("UIDs %v; want %d, %d", o.UIDs, os.Getuid(), os.Geteuid())
	}
	for field, got := range map[string]uint64{"CapEff": o.CapEff, "CapPrm": o.CapPrm, "CapBnd": o.CapBnd} {
		if want, _ := strconv.ParseUint(status[field], 16, 64); got != want {
			t.Errorf("%s %x; want %s", field, got, status[field])
		}
	}
	if o.NoNewPrivs != (status["NoNewPrivs"] == "1") || strconv.Itoa(o.Seccomp) != status["Seccomp"] {
		t.Errorf("NoNewPrivs %v, Seccomp %d; want %s, %s", o.NoNewPrivs, o.Seccomp, status["NoNewPrivs"], status["Seccomp"])
	}

	gone := exec.Command("/bin/true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	if _, err := Observe(gone.Process.Pid); err == nil {
		t.Errorf("Observe of an ended process: no error")
	}
}
