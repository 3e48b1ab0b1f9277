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
