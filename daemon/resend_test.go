package daemon

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/privsep"
)

// withholdingMode is the WorkerEnv value that starts withholdingWorker.
const withholdingMode = "withholding"

// withholdingWorker is the fake worker of TestWorkerWithholdsPayload: it
// takes its configuration, sends a payload of "v1" for the mount "app",
// and then says in the daemon's log each time the monitor asks for the
// payload again (privsep.Resend) — answering only the second time.
func withholdingWorker() {
	conn := privsep.WorkerConn()
	seq := awaitApply(conn)
	e := privsep.NewEncoder(conn)
	e.Encode(&privsep.Applied{Seq: seq})
	good := func(gen uint64) {
		e.Encode(&privsep.MountState{Mount: "app", Generation: gen, Revision: "main@1"})
		e.Encode(&privsep.Begin{Mount: "app", Revision: "main@1", Files: 1})
		e.EncodeFile("app.conf", 0o644, []byte("v1"))
		e.Encode(&privsep.Commit{})
		e.Flush()
	}
	good(1)
	d := privsep.NewDecoder(conn, privsep.FromMonitor)
	asked := 0
	for {
		m, err := d.Decode()
		if err != nil {
			os.Exit(0)
		}
		if r, ok := m.(*privsep.Resend); ok {
			asked++
			e.Encode(&privsep.Log{Level: 0, Message: "payload asked again", Attrs: []string{"asked", r.Mount + " " + strconv.Itoa(asked)}})
			e.Flush()
			if asked == 2 {
				good(2)
			}
		}
	}
}

// TestWorkerWithholdsPayload: the monitor holds no payload once written,
// and a worker — taken over, say — may not answer when drift makes the
// monitor ask for it again. The mount is then reported stale with why,
// the monitor asks again 5 s later (not more often), nothing else waits
// on it, and the payload that comes at last repairs the drift.
func TestWorkerWithholdsPayload(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("app", "/apps/app/"))
	h.workerMode = withholdingMode
	h.start()
	dir := h.path("mnt", "app")
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	// An edit in place, of the same size.
	if err := os.WriteFile(filepath.Join(dir, "..data", "app.conf"), []byte("XX"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.waitLog("drift found; asking for the payload again to repair it", "mount=app")
	h.waitLog("payload asked again", "asked=\"app 1\"")
	first := time.Now()
	stale := false
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline) && !stale; time.Sleep(50 * time.Millisecond) {
		_, body := unixGet(t, h.statusSocket(), "/status")
		var st admin.Status
		if err := json.Unmarshal([]byte(body), &st); err != nil {
			t.Fatal(err)
		}
		m := st.Mounts["app"]
		stale = m != nil && m.State == admin.StateStale && strings.Contains(m.LastError, "the payload is asked for again")
	}
	if !stale {
		t.Error("/status does not say the mount is stale, its payload asked for again")
	}
	if got, _ := content(dir); got["app.conf"] != "XX" {
		t.Fatalf("the mount holds %v before the worker answered; want the drift left as it is", got)
	}
	h.waitLog("payload asked again", "asked=\"app 2\"")
	if took := time.Since(first); took < 4*time.Second {
		t.Errorf("asked again %v after the first request; want 5 s (fetchAgain)", took.Round(time.Millisecond))
	}
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	h.waitLog("repaired drift", "mount=app")
}

// TestRestartSendsUnchangedPayloads: at a restart, a payload equal to what
// its mount holds on disk does not cross from the worker — its digest
// does (privsep.Unchanged) — and the version on disk is kept, not
// rewritten. A mount changed in the store while kvmount was down crosses
// whole and is written. One whose file was edited in place while kvmount
// was down is found drifted — by the adoption or by the verification
// after it — and its payload, asked for, repairs it. /status counts both
// forms.
func TestRestartSendsUnchangedPayloads(t *testing.T) {
	h := newHarness(t)
	h.put("/k/a", "1", "/k/dir/b", "2", "/c/x", "old", "/e/y", "yy")
	h.writeConfig(h.mount("keep", "/k/") + h.mount("changed", "/c/") + h.mount("edited", "/e/"))
	h.start()
	keep, changed, edited := h.path("mnt", "keep"), h.path("mnt", "changed"), h.path("mnt", "edited")
	version := h.waitContent(keep, map[string]string{"a": "1", "dir/b": "2"})
	h.waitContent(changed, map[string]string{"x": "old"})
	h.waitContent(edited, map[string]string{"y": "yy"})
	before, err := os.Stat(filepath.Join(keep, "a"))
	if err != nil {
		t.Fatal(err)
	}
	h.waitReady()
	h.stop()

	h.put("/c/x", "new")
	if err := os.WriteFile(filepath.Join(edited, "..data", "y"), []byte("XX"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.start()
	h.waitReady()
	h.waitContent(changed, map[string]string{"x": "new"})
	h.waitContent(edited, map[string]string{"y": "yy"})
	if _, v := content(keep); v != version {
		t.Errorf("..data points at %s after the restart; want %s kept", v, version)
	}
	if after, err := os.Stat(filepath.Join(keep, "a")); err != nil || !os.SameFile(before, after) {
		t.Errorf("file a was written again by the restart (%v)", err)
	}
	_, body := unixGet(t, h.statusSocket(), "/status")
	var st admin.Status
	if err := json.Unmarshal([]byte(body), &st); err != nil || len(st.Workers) != 1 {
		t.Fatalf("/status: %v\n%s", err, body)
	}
	// keep and edited as Unchanged; changed whole, and edited whole
	// once asked for.
	if w := st.Workers[0]; w.Unchanged != 2 || w.Payloads != 2 {
		t.Errorf("the restarted daemon took %d payloads whole and %d unchanged; want 2 and 2", w.Payloads, w.Unchanged)
	}
	h.put("/k/a", "changed")
	h.waitContent(keep, map[string]string{"a": "changed", "dir/b": "2"})
}
