package daemon

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestWorkerHoldsNoPrivilege is issue 28's process tree: the daemon's
// worker, as the kernel shows it in /proc/PID/status, is not root, holds
// no capability in any set, has no_new_privs and a seccomp filter, and
// says it is confined; the mount is projected through it; killing it
// keeps the mount's content, and a new worker follows the next change.
func TestWorkerHoldsNoPrivilege(t *testing.T) {
	h := newHarness(t)
	h.put("/apps/app/app.conf", "v1")
	h.writeConfig(h.mount("app", "/apps/app/"))
	h.start()
	dir := h.path("mnt", "app")
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	h.waitLog("worker confined", "landlock_abi=", "seccomp=true", "from=worker")
	pid := workerPID(t, h, 1)
	status, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		t.Fatal(err)
	}
	fields := map[string]string{}
	for _, line := range strings.Split(string(status), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			fields[k] = strings.Join(strings.Fields(v), " ")
		}
	}
	if uid := strings.Fields(fields["Uid"]); len(uid) != 4 || slices.Contains(uid, "0") {
		t.Errorf("the worker's Uid: %q; want no id 0", fields["Uid"])
	}
	for k, v := range map[string]string{"CapEff": "0000000000000000", "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
		"CapInh": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"} {
		if fields[k] != v {
			t.Errorf("the worker's %s: %q; want %q", k, fields[k], v)
		}
	}
	// A worker that dies: logged, the content kept, a new one started.
	n := 0
	for _, c := range pid {
		n = n*10 + int(c-'0')
	}
	if err := syscall.Kill(n, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	h.waitLog("the worker ended; starting it again", "signal: killed")
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	workerPID(t, h, 2)
	h.put("/apps/app/app.conf", "v2")
	h.waitContent(dir, map[string]string{"app.conf": "v2"})
}

// workerPID returns the PID of the nth worker the daemon started, from
// its log, waiting for it for 30 s at most.
func workerPID(t *testing.T, h *harness, nth int) string {
	t.Helper()
	re := regexp.MustCompile(`msg="worker started" pid=([0-9]+)`)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if m := re.FindAllStringSubmatch(h.logs.String(), -1); len(m) >= nth {
			return m[nth-1][1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no worker %d started within 30 s:\n%s", nth, h.logs)
		}
	}
}
