package admin

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
)

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(body)
}

// TestEndpoints feeds the server the events of a small run and reads
// every route.
func TestEndpoints(t *testing.T) {
	alive := true
	s := New(Options{Version: "v1.2.3", Ping: func(context.Context) error {
		if !alive {
			return errors.New("stuck")
		}
		return nil
	}})
	h := s.Handler()
	if code, body := get(t, h, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "first pass") {
		t.Errorf("/readyz before the first pass = %d %q", code, body)
	}
	now := time.Date(2026, 11, 22, 1, 2, 3, 0, time.UTC)
	s.Observe(reconcile.SourceEvent{Source: "main", Revision: "42", Time: now})
	s.Observe(reconcile.ProjectedEvent{Mount: "app", Dir: "/run/app", Medium: "disk", Op: "setup", Revision: "main@42", Version: "..v1",
		Change: projector.Change{Added: []string{"a"}}, Files: 1, Bytes: 5, Duration: 3 * time.Millisecond, Time: now})
	s.Observe(reconcile.PassEvent{Time: now, Mounts: []reconcile.MountStatus{
		{Name: "app", Dir: "/run/app", Medium: "disk", Projected: true},
		{Name: "opt", Dir: "/run/opt", Medium: "disk", Optional: true, Waiting: []string{"main"}},
	}})
	s.NotifyResult(notify.Result{Mount: "app", Version: "..v1", Kind: "command", Target: "nginx", Attempt: 1, Duration: time.Millisecond, Time: now})
	if code, body := get(t, h, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz = %d %q; want 200", code, body)
	}
	code, body := get(t, h, "/status")
	var st Status
	if err := json.Unmarshal([]byte(body), &st); code != http.StatusOK || err != nil {
		t.Fatalf("/status = %d %v", code, err)
	}
	app := st.Mounts["app"]
	if !st.Ready || app == nil || app.State != StateCurrent || app.Version != "..v1" || app.Revision != "main@42" || app.Files != 1 || app.Bytes != 5 ||
		app.LastSuccess == nil || app.LastChange == nil || app.LastNotification == nil || !app.LastNotification.OK || st.Sources["main"] == nil || !st.Sources["main"].Up {
		t.Errorf("/status = %s", body)
	}
	if st.Mounts["opt"].State != StateOptional {
		t.Errorf("optional mount state %q", st.Mounts["opt"].State)
	}

	// The source goes down: the mount turns stale, /readyz says why.
	s.Observe(reconcile.SourceEvent{Source: "main", Err: errors.New("unreachable"), Time: now})
	s.Observe(reconcile.PassEvent{Time: now.Add(time.Second), Mounts: []reconcile.MountStatus{
		{Name: "app", Dir: "/run/app", Medium: "disk", Projected: true, Stale: []error{errors.New(`source "main": unreachable`)}},
	}})
	s.Observe(reconcile.HeldBackEvent{Mount: "app", Guard: "min_keys", Time: now})
	s.Observe(reconcile.FailedEvent{Mount: "app", Op: "remount", Guard: "check_command", Err: errors.New("nope"), Time: now})
	s.NotifyResult(notify.Result{Mount: "app", Kind: "webhook", Err: errors.New("502"), Time: now})
	if code, body := get(t, h, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, `mount app is stale: source "main": unreachable`) {
		t.Errorf("/readyz with a stale mount = %d %q", code, body)
	}
	_, body = get(t, h, "/status")
	if !strings.Contains(body, `"stale_since"`) || strings.Contains(body, `"opt"`) {
		t.Errorf("/status: %s; want stale_since, and the removed mount gone", body)
	}
	_, metrics := get(t, h, "/metrics")
	for _, want := range []string{
		`kvmount_build_info{goversion="go`, `version="v1.2.3"} 1`,
		`kvmount_mount_projected{mount="app"} 1`,
		`kvmount_mount_files{mount="app"} 1`,
		`kvmount_mount_bytes{mount="app"} 5`,
		`kvmount_mount_last_success_timestamp_seconds{mount="app"} 1.795309323e+09`,
		`kvmount_mount_last_change_timestamp_seconds{mount="app"} 1.795309323e+09`,
		`kvmount_projections_total{mount="app",result="changed"} 1`,
		`kvmount_projections_total{mount="app",result="held_back"} 1`,
		`kvmount_projections_total{mount="app",result="failed"} 1`,
		`kvmount_projection_duration_seconds_count 1`,
		`kvmount_guard_rejections_total{guard="check_command",mount="app"} 1`,
		`kvmount_guard_rejections_total{guard="min_keys",mount="app"} 1`,
		`kvmount_notify_total{kind="command",mount="app",result="success"} 1`,
		`kvmount_notify_total{kind="webhook",mount="app",result="failure"} 1`,
		`kvmount_notify_duration_seconds_count{kind="command"} 1`,
		`kvmount_source_up{source="main"} 0`,
		`kvmount_source_errors_total{source="main"} 1`,
		`go_goroutines `, `process_resident_memory_bytes `,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if strings.Contains(metrics, `mount="opt"`) {
		t.Errorf("/metrics still has series of the removed mount opt")
	}

	if code, _ := get(t, h, "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d; want 200", code)
	}
	alive = false
	if code, body := get(t, h, "/healthz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "stuck") {
		t.Errorf("/healthz with the loop stuck = %d %q", code, body)
	}
}

// TestListenUnixSocket serves on a unix socket.
func TestListenUnixSocket(t *testing.T) {
	path := t.TempDir() + "/admin.sock"
	l, err := Listen("unix:" + path)
	if err != nil {
		t.Fatal(err)
	}
	s := New(Options{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, l) }()
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}}
	resp, err := client.Get("http://kvmount/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/healthz over the socket = %d", resp.StatusCode)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve = %v", err)
	}
}
