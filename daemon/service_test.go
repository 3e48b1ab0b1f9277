package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/admin"
)

// logLines returns the lines of the file at path.
func logLines(path string) []string {
	data, _ := os.ReadFile(path)
	return strings.Fields(strings.ReplaceAll(string(data), " ", "_"))
}

// waitLines waits until the file at path has n lines.
func (h *harness) waitLines(path string, n int) []string {
	h.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		if got := logLines(path); len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s has %d lines; want %d", path, len(logLines(path)), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestNotifyAfterSwitch: the notify command runs after the switch (it
// reads the new content through the visible name), once per change,
// including the first projection; a restart that adopts unchanged content
// notifies nothing.
func TestNotifyAfterSwitch(t *testing.T) {
	h := newHarness(t)
	log := filepath.Join(sharedDir(t), "notified") // notify commands run as nobody
	h.put("/n/a", "1")
	notify := fmt.Sprintf(`  [[mount.notify]]
  command = ["sh", "-c", "echo $KVMOUNT_MOUNT:$KVMOUNT_VERSION:$(cat $KVMOUNT_DIR/a) >> %s"]
`, log)
	h.writeConfig(h.mount("n", "/n/") + notify)
	h.start()
	dir := h.path("mnt", "n")
	v1 := h.waitContent(dir, map[string]string{"a": "1"})
	if got := h.waitLines(log, 1); got[0] != "n:"+v1+":1" {
		t.Errorf("first projection notified %q; want n:%s:1", got[0], v1)
	}
	h.put("/n/a", "2")
	v2 := h.waitContent(dir, map[string]string{"a": "2"})
	if got := h.waitLines(log, 2); got[1] != "n:"+v2+":2" {
		t.Errorf("change notified %q; want n:%s:2 (after the switch)", got[1], v2)
	}
	h.waitReady()
	h.stop()
	h.start()
	h.waitReady()
	h.put("/n/a", "3")
	v3 := h.waitContent(dir, map[string]string{"a": "3"})
	got := h.waitLines(log, 3)
	if len(got) != 3 || got[2] != "n:"+v3+":3" {
		t.Errorf("after a restart: notified %q; want only the change to 3 (the adoption is no change)", got)
	}
}

// TestQuiescence: with wait = { min, max }, a burst of changes becomes one
// switch and one notification.
func TestQuiescence(t *testing.T) {
	h := newHarness(t)
	log := filepath.Join(sharedDir(t), "notified") // notify commands run as nobody
	h.put("/q/a", "0")
	h.writeConfig(h.mount("q", "/q/", `wait = { min = "500ms", max = "10s" }`) + fmt.Sprintf("  [[mount.notify]]\n  command = [\"sh\", \"-c\", \"echo $KVMOUNT_VERSION >> %s\"]\n", log))
	h.start()
	dir := h.path("mnt", "q")
	h.waitContent(dir, map[string]string{"a": "0"}) // the first setup does not wait
	h.waitLines(log, 1)
	projected := h.logs.Count("msg=projected", "mount=q")
	for i := 1; i <= 10; i++ {
		h.put("/q/a", fmt.Sprint(i))
		time.Sleep(20 * time.Millisecond) // a burst: changes 20 ms apart, well within min
	}
	h.waitContent(dir, map[string]string{"a": "10"})
	h.waitLines(log, 2)
	if n := h.logs.Count("msg=projected", "mount=q") - projected; n != 1 {
		t.Errorf("the burst of 10 changes made %d switches; want 1", n)
	}
	if got := logLines(log); len(got) != 2 {
		t.Errorf("notified %d times; want 2 (the first projection, then the burst once)", len(got))
	}
}

// unixGet GETs path from an admin endpoint on a unix socket, waiting for
// it to listen: the endpoints listen in the background.
func unixGet(t *testing.T, socket, path string) (int, string) {
	t.Helper()
	// One connection per request: the endpoint serves at most
	// admin.MaxConnections at once, and kept-alive ones count.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}, Timeout: 10 * time.Second}
	var resp *http.Response
	var err error
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		if resp, err = client.Get("http://kvmount" + path); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// TestAdminEndpoint: /status, /readyz, /healthz and /metrics of a running
// daemon, before and during an etcd outage; systemd's STATUS= line.
func TestAdminEndpoint(t *testing.T) {
	h := newHarness(t)
	socket := h.path("admin.sock")
	h.admin = "unix:" + socket
	h.put("/ad/a", "1")
	h.writeConfig(h.mount("ad", "/ad/"))
	h.start()
	h.waitContent(h.path("mnt", "ad"), map[string]string{"a": "1"})
	h.waitReady()
	deadline := time.Now().Add(waitTimeout)
	for {
		if code, _ := unixGet(t, socket, "/readyz"); code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("/readyz never 200")
		}
		time.Sleep(10 * time.Millisecond)
	}
	_, body := unixGet(t, h.statusSocket(), "/status")
	var st admin.Status
	if err := json.Unmarshal([]byte(body), &st); err != nil {
		t.Fatal(err)
	}
	if m := st.Mounts["ad"]; m == nil || m.State != admin.StateCurrent || m.Files != 1 || m.Dir != h.path("mnt", "ad") || !st.Sources["main"].Up {
		t.Errorf("/status = %s", body)
	}
	if code, _ := unixGet(t, socket, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d", code)
	}
	_, metrics := unixGet(t, socket, "/metrics")
	for _, want := range []string{`kvmount_mount_projected{mount="ad"} 1`, `kvmount_source_up{source="main"} 1`, `kvmount_projections_total{mount="ad",result="changed"} 1`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	h.statusMu.Lock()
	lines := strings.Join(h.statusLines, "\n")
	h.statusMu.Unlock()
	if !strings.Contains(lines, "1 mount: 1 current") {
		t.Errorf("STATUS= lines %q; want \"1 mount: 1 current\"", lines)
	}

	h.etcd.Stop()
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		code, body := unixGet(t, socket, "/readyz")
		if code == http.StatusServiceUnavailable && strings.Contains(body, "mount ad is stale") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz during the outage = %d %q", code, body)
		}
	}
	_, metrics = unixGet(t, socket, "/metrics")
	if !strings.Contains(metrics, `kvmount_source_up{source="main"} 0`) {
		t.Errorf("/metrics during the outage lacks kvmount_source_up 0")
	}
	if err := h.etcd.Restart(); err != nil {
		t.Fatal(err)
	}
	h.statusMu.Lock()
	lines = strings.Join(h.statusLines, "\n")
	h.statusMu.Unlock()
	if !strings.Contains(lines, "1 mount: 1 stale (ad: source \"main\"") {
		t.Errorf("STATUS= lines %q; want the stale mount and why", lines)
	}
}

// TestFailingNotificationIsReported: while a mount's notification keeps
// failing, /status says notify_failed (kvmount status exits 1 on it), the
// metric kvmount_mount_notify_failing is 1 and systemd's status line says
// so in the same word; /readyz stays 200, the files being current. Once
// the target works again, the retry succeeds and all of it clears.
func TestFailingNotificationIsReported(t *testing.T) {
	h := newHarness(t)
	socket := h.path("admin.sock")
	h.admin = "unix:" + socket
	gate := h.path("gate")
	h.put("/nf/a", "1")
	h.writeConfig(h.mount("nf", "/nf/", "[[mount.notify]]\ncommand = [\"test\", \"-e\", \""+gate+"\"]\n"))
	h.start()
	h.waitContent(h.path("mnt", "nf"), map[string]string{"a": "1"})
	state := func(want string) {
		t.Helper()
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(20 * time.Millisecond) {
			_, body := unixGet(t, h.statusSocket(), "/status")
			var st admin.Status
			if err := json.Unmarshal([]byte(body), &st); err == nil && st.Mounts["nf"] != nil && st.Mounts["nf"].State == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("/status never said %s: %s", want, body)
			}
		}
	}
	state(admin.StateNotifyFailed)
	h.waitMetric(socket, `kvmount_mount_notify_failing{mount="nf"} 1`)
	if code, body := unixGet(t, socket, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz = %d %q; want 200: the files are current", code, body)
	}
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(20 * time.Millisecond) {
		h.statusMu.Lock()
		lines := strings.Join(h.statusLines, "\n")
		h.statusMu.Unlock()
		if strings.Contains(lines, "1 mount: 1 notify_failed (nf: notification command test: command test: exit status 1)") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("STATUS= lines %q lack the failing notification", lines)
		}
	}
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	state(admin.StateCurrent)
	h.waitMetric(socket, `kvmount_mount_notify_failing{mount="nf"} 0`)
}

// TestAdminAddressOnReload: a reload that changes [admin] address and
// socket moves the endpoints (the review saw systemctl reload return 0 and
// kvmount status then miss the daemon, which kept the old address).
func TestAdminAddressOnReload(t *testing.T) {
	h := newHarness(t)
	first, second := h.path("first.sock"), h.path("second.sock")
	h.admin = "unix:" + first
	h.put("/ar/a", "1")
	h.writeConfig(h.mount("ar", "/ar/"))
	h.start()
	h.waitContent(h.path("mnt", "ar"), map[string]string{"a": "1"})
	if code, _ := unixGet(t, first, "/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz on %s = %d", first, code)
	}
	data, err := os.ReadFile(h.config)
	if err != nil {
		t.Fatal(err)
	}
	moved := strings.Replace(string(data), first, second, 1)
	moved = strings.Replace(moved, h.statusSocket(), h.path("run2", "kvmount.sock"), 1)
	if err := os.WriteFile(h.config, []byte(moved), 0o644); err != nil {
		t.Fatal(err)
	}
	h.sighup()
	h.waitNotified("reloading")
	h.waitNotified("ready")
	if code, _ := unixGet(t, second, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz on the new address = %d", code)
	}
	if code, _ := unixGet(t, h.path("run2", "kvmount.sock"), "/status"); code != http.StatusOK {
		t.Errorf("/status on the new socket = %d", code)
	}
	for _, old := range []string{first, h.statusSocket()} {
		h.waitGone(old)
	}
}
