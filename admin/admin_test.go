package admin

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/roottest"
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
		`kvmount_mount_notify_failing{mount="app"} 1`,
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
// unixClient returns a client that reaches the unix socket at path.
func unixClient(path string) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}}
}

// getURL GETs url with client and returns the status code, or 0 when the
// endpoint cannot be reached.
func getURL(client *http.Client, url string) int {
	resp, err := client.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// waitCode waits until GET url answers want.
func waitCode(t *testing.T, client *http.Client, url string, want int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); getURL(client, url) != want; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("GET %s never answered %d", url, want)
		}
	}
}

// TestTeardownRefusalCounted: a mount that left the configuration and
// whose teardown a guard refuses keeps its guard series until it is torn
// down, without coming back in /status, where it would keep /readyz from
// being ready.
func TestTeardownRefusalCounted(t *testing.T) {
	s := New(Options{Version: "test"})
	h := s.Handler()
	now := time.Now()
	s.Observe(reconcile.PassEvent{Time: now, Mounts: []reconcile.MountStatus{{Name: "app", Projected: true}}})
	s.Observe(reconcile.PassEvent{Time: now, Mounts: nil}) // "old" left the configuration
	s.Observe(reconcile.FailedEvent{Mount: "old", Op: "teardown", Guard: "mount_dir_unrecognized", Err: errors.New("unrecognized"), Time: now})
	s.Observe(reconcile.PassEvent{Time: now, Mounts: nil})
	want := `kvmount_guard_rejections_total{guard="mount_dir_unrecognized",mount="old"} 1`
	if _, metrics := get(t, h, "/metrics"); !strings.Contains(metrics, want) {
		t.Errorf("/metrics lacks %s", want)
	}
	if st := s.Status(); st.Mounts["old"] != nil || !st.Ready {
		t.Errorf("/status after a refused teardown: mount old %v, ready %v; want no entry, ready", st.Mounts["old"], st.Ready)
	}
	s.Observe(reconcile.TornDownEvent{Mount: "old", Time: now})
	if _, metrics := get(t, h, "/metrics"); strings.Contains(metrics, `mount="old"`) {
		t.Errorf("/metrics still has series of the torn-down mount old")
	}
}

// TestEndpointsListen: the public endpoint (TCP or a 0660 socket) serves
// /metrics, /healthz and /readyz but not /status; the private socket, born
// 0600 in a directory it creates, serves everything; a reload moves them;
// a port someone else holds is retried in the background, and reported,
// until it is free.
func TestEndpointsListen(t *testing.T) {
	old := syscall.Umask(0o022)
	defer syscall.Umask(old)
	base := t.TempDir()
	private := filepath.Join(base, "run", "kvmount.sock")
	squat, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	taken := squat.Addr().String()
	s := New(Options{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	s.SetEndpoints(Endpoints{Address: taken, Socket: private})
	priv := unixClient(private)
	waitCode(t, priv, "http://kvmount/status", http.StatusOK)
	for path, want := range map[string]os.FileMode{private: 0o600, filepath.Dir(private): 0o755} {
		if info, err := os.Lstat(path); err != nil || info.Mode().Perm() != want {
			t.Errorf("%s: %v, %v; want mode %v", path, info.Mode(), err, want)
		}
	}
	// The two endpoints listen on their own: the private one may answer
	// before the public one's attempt is recorded.
	st := s.Status()
	for deadline := time.Now().Add(30 * time.Second); len(st.Endpoints) != 2 || st.Endpoints[0].Error == ""; st = s.Status() {
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if len(st.Endpoints) != 2 || st.Endpoints[0].Address != taken || st.Endpoints[0].Listening || !strings.Contains(st.Endpoints[0].Error, "address already in use") {
		t.Errorf("endpoints %+v; want %s not listening, in use", st.Endpoints, taken)
	}
	squat.Close()
	public := &http.Client{Timeout: 5 * time.Second}
	waitCode(t, public, "http://"+taken+"/healthz", http.StatusOK)
	for _, path := range []string{"/metrics", "/readyz"} {
		if code := getURL(public, "http://"+taken+path); code == 0 || code == http.StatusNotFound {
			t.Errorf("public %s = %d", path, code)
		}
	}
	if code := getURL(public, "http://"+taken+"/status"); code != http.StatusNotFound && code != http.StatusMethodNotAllowed {
		t.Errorf("public /status = %d; want it not served", code)
	}
	// A reload moves the public endpoint to a unix socket.
	sock := filepath.Join(base, "metrics.sock")
	s.SetEndpoints(Endpoints{Address: "unix:" + sock, Socket: private})
	waitCode(t, unixClient(sock), "http://kvmount/metrics", http.StatusOK)
	if info, err := os.Lstat(sock); err != nil || info.Mode().Perm() != 0o660 {
		t.Errorf("public socket mode %v, %v; want 0660", info.Mode(), err)
	}
	if getURL(public, "http://"+taken+"/healthz") != 0 {
		t.Error("the old address still answers after the reload")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}
	for _, p := range []string{sock, private} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s left behind: %v", p, err)
		}
	}
}

// TestSocketsAreMadeSafely: a stale socket is replaced, a live one (another
// daemon's) never removed; a symlink in the socket's path, or a private
// socket's directory that others can write, is refused — and nothing is
// ever chmod'ed by path.
func TestSocketsAreMadeSafely(t *testing.T) {
	base := t.TempDir()
	live := filepath.Join(base, "live.sock")
	l, err := net.Listen("unix", live)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := listen("unix:"+live, false); err == nil || !strings.Contains(err.Error(), "another process listens on it") {
		t.Errorf("listen on a live socket = %v", err)
	}
	stale := filepath.Join(base, "stale.sock")
	sl, _ := net.Listen("unix", stale)
	sl.(*net.UnixListener).SetUnlinkOnClose(false)
	sl.Close()
	if nl, err := listen("unix:"+stale, false); err != nil {
		t.Errorf("listen over a stale socket = %v", err)
	} else {
		nl.Close()
	}
	if err := os.WriteFile(filepath.Join(base, "file.sock"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := listen("unix:"+filepath.Join(base, "file.sock"), false); err == nil {
		t.Error("listen over a regular file succeeded")
	}
	if err := os.Symlink(base, filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	if _, err := listen("unix:"+filepath.Join(base, "link", "x.sock"), true); !errors.Is(err, fsutil.ErrSymlink) {
		t.Errorf("listen through a symlink = %v; want fsutil.ErrSymlink", err)
	}
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := listen("unix:"+filepath.Join(open, "x.sock"), true); err == nil || !strings.Contains(err.Error(), "writable by kvmount's user alone") {
		t.Errorf("a private socket in a world-writable directory = %v", err)
	}
}

// TestSocketSymlinkRace is the review's twelfth finding, played by a real
// unprivileged user who owns the public socket's directory and swaps the
// socket for a symlink to a root-only file, again and again, while
// kvmount makes the socket: the file's mode never changes (the review saw
// root chmod it to 0660 through the symlink).
func TestSocketSymlinkRace(t *testing.T) {
	u := roottest.NewUser(t)
	base := roottest.TempDir(t)
	victim := filepath.Join(base, "shadow")
	if err := os.WriteFile(victim, []byte("root:$6$hash\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "run")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, dir)
	sock := filepath.Join(dir, "admin.sock")
	racer := u.Command("sh", "-c", "end=$(($(date +%s) + 3)); while [ $(date +%s) -lt $end ]; do rm -f "+sock+"; ln -s "+victim+" "+sock+"; done")
	if err := racer.Start(); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
		if l, err := listen("unix:"+sock, false); err == nil {
			l.Close()
		}
	}
	racer.Wait()
	info, err := os.Stat(victim)
	if err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("the root-only file is now %v, %v; want 0600", info.Mode(), err)
	}
}
