package notify

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
)

const waitTimeout = 30 * time.Second

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// results collects a Notifier's results.
type results struct {
	mu   sync.Mutex
	list []Result
}

func (r *results) add(res Result) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.list = append(r.list, res)
}

func (r *results) all() []Result {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Result(nil), r.list...)
}

// waitFor waits until cond holds for the results.
func (r *results) waitFor(t *testing.T, what string, cond func([]Result) bool) []Result {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		if got := r.all(); cond(got) {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("never %s; results %+v", what, r.all())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func start(t *testing.T, mount string, entries ...config.Notify) (*Notifier, *results) {
	t.Helper()
	r := &results{}
	n := New(Options{Log: discard, OnResult: r.add})
	t.Cleanup(n.Close)
	n.SetMounts([]*config.Mount{{Name: mount, Notify: entries}})
	return n, r
}

func change(mount, version string) Change {
	return Change{Mount: mount, Dir: os.TempDir(), Version: version, Revision: "main@" + version, Added: []string{"a.conf"}, Changed: []string{"b/c.conf"}}
}

// TestCommandGetsTheChange: a command entry runs with the change in its
// environment, in the mount's directory.
func TestCommandGetsTheChange(t *testing.T) {
	out := filepath.Join(t.TempDir(), "env")
	n, r := start(t, "app", config.Notify{Kind: config.NotifyCommand, Command: []string{"sh", "-c", "env | grep -E '^KVMOUNT_(MOUNT|DIR|VERSION|REVISION)=' | sort > " + out}, Timeout: 5 * time.Second})
	c := change("app", "..v1")
	c.Dir = t.TempDir()
	n.Notify(c)
	r.waitFor(t, "notified", func(rs []Result) bool { return len(rs) == 1 })
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("KVMOUNT_DIR=%s\nKVMOUNT_MOUNT=app\nKVMOUNT_REVISION=main@..v1\nKVMOUNT_VERSION=..v1\n", c.Dir)
	if string(data) != want {
		t.Errorf("environment:\n%s\nwant:\n%s", data, want)
	}
	if res := r.all()[0]; res.Err != nil || res.Kind != "command" || res.Target != "sh" || res.Attempt != 1 {
		t.Errorf("result %+v", res)
	}
}

// TestSignalReachesTheProcess: a child that counts SIGHUPs gets one per
// change; its PID file is read at each notification.
func TestSignalReachesTheProcess(t *testing.T) {
	dir := t.TempDir()
	pidFile, count := filepath.Join(dir, "pid"), filepath.Join(dir, "count")
	child := exec.Command("sh", "-c", `trap 'echo hup >> `+count+`' HUP; echo $$ > `+pidFile+`.tmp; mv `+pidFile+`.tmp `+pidFile+`; while :; do sleep 0.05; done`)
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	deadline := time.Now().Add(waitTimeout)
	for _, err := os.Stat(pidFile); err != nil; _, err = os.Stat(pidFile) {
		if time.Now().After(deadline) {
			t.Fatal("the child never wrote its PID file")
		}
		time.Sleep(5 * time.Millisecond)
	}
	n, r := start(t, "app", config.Notify{Kind: config.NotifySignal, Signal: syscall.SIGHUP, PIDFile: pidFile, Timeout: time.Second})
	for i := 1; i <= 3; i++ {
		n.Notify(change("app", fmt.Sprint(i)))
		r.waitFor(t, "notified", func(rs []Result) bool { return len(rs) == i })
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(5 * time.Millisecond) {
			data, _ := os.ReadFile(count)
			if strings.Count(string(data), "hup") == i {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the child counted %q; want %d SIGHUPs", data, i)
			}
		}
	}
}

// TestSignalErrors: a missing PID file, PID 1 and a dead process are clear
// errors.
func TestSignalErrors(t *testing.T) {
	dir := t.TempDir()
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	for name, content := range map[string]string{"one": "1\n", "dead": fmt.Sprint(dead.Process.Pid), "junk": "nginx\n"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for file, want := range map[string]string{
		"missing": "no such file",
		"one":     "names PID 1; refusing to signal it",
		"dead":    "is not running",
		"junk":    `holds "nginx", not a process ID`,
	} {
		err := sendSignal(config.Notify{Kind: config.NotifySignal, Signal: syscall.SIGHUP, PIDFile: filepath.Join(dir, file)})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("pid file %s: %v; want %q", file, err, want)
		}
	}
}

// TestWebhook: the change is POSTed as JSON — paths, never values — with
// the configured headers; a non-2xx answer is an error.
func TestWebhook(t *testing.T) {
	type seen struct {
		body   webhookBody
		ctype  string
		token  string
		custom string
	}
	got := make(chan seen, 10)
	status := http.StatusNoContent
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b webhookBody
		if err := json.NewDecoder(r.Body).Decode(&b); err != nil {
			t.Error(err)
		}
		got <- seen{b, r.Header.Get("Content-Type"), r.Header.Get("Authorization"), r.Header.Get("X-Env")}
		mu.Lock()
		defer mu.Unlock()
		w.WriteHeader(status)
		io.WriteString(w, "nope")
	}))
	defer srv.Close()
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("Bearer s3cr3t\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse("n.toml", []byte(fmt.Sprintf("[sources.s]\ntype = \"x\"\n[[mount]]\nname = \"app\"\ndir = \"/srv/app\"\nsource = \"s\"\nprefix = \"a/\"\n[[mount.notify]]\nwebhook = %q\nheaders = { X-Env = \"prod\" }\nheader_files = { Authorization = %q }\n", srv.URL+"/hook", tokenFile)),
		map[string]config.SourceDecoder{"x": func(s *config.Section) any { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	n, r := start(t, "app", cfg.Mounts[0].Notify...)
	n.Notify(change("app", "..v1"))
	s := <-got
	if s.body.Mount != "app" || s.body.Version != "..v1" || s.body.Revision != "main@..v1" || fmt.Sprint(s.body.Added, s.body.Changed, s.body.Removed) != "[a.conf] [b/c.conf] []" ||
		s.ctype != "application/json" || s.token != "Bearer s3cr3t" || s.custom != "prod" {
		t.Errorf("webhook got %+v", s)
	}
	r.waitFor(t, "a success", func(rs []Result) bool { return len(rs) == 1 && rs[0].Err == nil })
	mu.Lock()
	status = http.StatusBadGateway
	mu.Unlock()
	n.Notify(change("app", "..v2"))
	<-got
	rs := r.waitFor(t, "a failure", func(rs []Result) bool { return len(rs) == 2 })
	if err := rs[1].Err; err == nil || !strings.Contains(err.Error(), "502") || strings.Contains(err.Error(), "s3cr3t") {
		t.Errorf("failed webhook: %v; want the status, never the token", err)
	}
}

// TestRetriedUntilItSucceeds: an entry that fails twice is retried alone,
// with backoff (1 s, then 2 s), and the entries before it run once.
func TestRetriedUntilItSucceeds(t *testing.T) {
	dir := t.TempDir()
	first, flaky := filepath.Join(dir, "first"), filepath.Join(dir, "flaky")
	n, r := start(t, "app",
		config.Notify{Kind: config.NotifyCommand, Command: []string{"sh", "-c", "echo x >> " + first}, Timeout: 5 * time.Second},
		config.Notify{Kind: config.NotifyCommand, Command: []string{"sh", "-c", "echo x >> " + flaky + "; test $(wc -l < " + flaky + ") -ge 3"}, Timeout: 5 * time.Second})
	n.Notify(change("app", "..v1"))
	rs := r.waitFor(t, "the third attempt", func(rs []Result) bool { return len(rs) == 4 })
	if rs[0].Err != nil || rs[1].Err == nil || rs[2].Err == nil || rs[3].Err != nil || rs[3].Attempt != 3 {
		t.Errorf("results %+v; want the first entry once, the second failing twice then succeeding", rs)
	}
	if gap1, gap2 := rs[2].Time.Sub(rs[1].Time), rs[3].Time.Sub(rs[2].Time); gap1 < RetryMin || gap2 < 2*RetryMin {
		t.Errorf("retries after %v and %v; want at least %v and %v", gap1, gap2, RetryMin, 2*RetryMin)
	}
	if data, _ := os.ReadFile(first); string(data) != "x\n" {
		t.Errorf("the first entry ran %d times; want once", strings.Count(string(data), "x"))
	}
}

// TestCoalescedAndSuperseded: changes that arrive while a notification
// runs become one more notification, for the newest version; a failing
// entry stops retrying when a newer version arrives.
func TestCoalescedAndSuperseded(t *testing.T) {
	dir := t.TempDir()
	log, gate := filepath.Join(dir, "log"), filepath.Join(dir, "gate")
	// The command logs its version, then fails while the gate file is
	// missing (after a pause for the first one, so changes pile up).
	script := `echo "$KVMOUNT_VERSION" >> ` + log + `; if [ "$KVMOUNT_VERSION" = v1 ]; then sleep 0.3; fi; test -e ` + gate
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	n, r := start(t, "app", config.Notify{Kind: config.NotifyCommand, Command: []string{"sh", "-c", script}, Timeout: 5 * time.Second})
	n.Notify(change("app", "v1"))
	r.waitFor(t, "", func([]Result) bool { data, _ := os.ReadFile(log); return len(data) > 0 })
	for _, v := range []string{"v2", "v3", "v4"} {
		n.Notify(change("app", v))
	}
	r.waitFor(t, "two notifications", func(rs []Result) bool { return len(rs) == 2 })
	if data, _ := os.ReadFile(log); string(data) != "v1\nv4\n" {
		t.Errorf("notified %q; want v1, then only the newest (v4)", data)
	}
	// Now a failing one, superseded during its backoff.
	if err := os.Remove(gate); err != nil {
		t.Fatal(err)
	}
	n.Notify(change("app", "v5"))
	r.waitFor(t, "v5 failing", func(rs []Result) bool { return len(rs) == 3 && rs[2].Err != nil })
	if err := os.WriteFile(gate, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	n.Notify(change("app", "v6"))
	rs := r.waitFor(t, "v6", func(rs []Result) bool { return len(rs) == 4 })
	if rs[3].Version != "v6" || rs[3].Err != nil {
		t.Errorf("after a newer version: %+v; want v6 notified and v5 no longer retried", rs[3])
	}
	time.Sleep(1500 * time.Millisecond) // past v5's retry time: it must not come back
	if got := r.all(); len(got) != 4 {
		t.Errorf("v5 was retried after v6 superseded it: %+v", got[4:])
	}
}

// TestSystemdWithoutSystemd: where the system bus cannot be reached the
// entry fails, through the real D-Bus client, with an error that says so.
// The bus address points at a socket that does not exist, so the test runs
// the same whether or not systemd runs here; the booted-container test in
// packaging/ covers a real systemd.
func TestSystemdWithoutSystemd(t *testing.T) {
	t.Setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path="+filepath.Join(t.TempDir(), "no-bus"))
	n := New(Options{Log: discard})
	defer n.Close()
	err := n.systemdJob(context.Background(), config.Notify{Kind: config.NotifySystemd, Unit: "nginx.service", Action: config.ActionReload, Timeout: 2 * time.Second})
	if err == nil || !strings.Contains(err.Error(), "systemd_unit nginx.service: connecting to systemd over D-Bus") {
		t.Errorf("systemd_unit without systemd: %v", err)
	}
}

// fakeManager stands in for systemd's D-Bus API, beside the real error
// path above: it records the calls and answers with a job result.
type fakeManager struct {
	calls  *[]string
	result string
}

func (f fakeManager) job(kind, name string, ch chan<- string) (int, error) {
	*f.calls = append(*f.calls, kind+" "+name)
	ch <- f.result
	return 1, nil
}
func (f fakeManager) ReloadUnitContext(_ context.Context, name, _ string, ch chan<- string) (int, error) {
	return f.job("reload", name, ch)
}
func (f fakeManager) RestartUnitContext(_ context.Context, name, _ string, ch chan<- string) (int, error) {
	return f.job("restart", name, ch)
}
func (f fakeManager) ReloadOrTryRestartUnitContext(_ context.Context, name, _ string, ch chan<- string) (int, error) {
	return f.job("reload-or-try-restart", name, ch)
}
func (fakeManager) Close() {}

type fakeConnector struct{ m fakeManager }

func (c fakeConnector) Connect(context.Context) (SystemdManager, error) { return c.m, nil }

// TestSystemdActions: each action calls its D-Bus method; a job that does
// not end "done" is an error.
func TestSystemdActions(t *testing.T) {
	var calls []string
	for _, tc := range []struct{ action, result, want string }{
		{config.ActionReload, "done", ""},
		{config.ActionRestart, "done", ""},
		{config.ActionTryReloadOrRestart, "failed", "try-reload-or-restart job failed"},
	} {
		n := New(Options{Log: discard, SystemdConn: fakeConnector{fakeManager{calls: &calls, result: tc.result}}})
		err := n.systemdJob(context.Background(), config.Notify{Kind: config.NotifySystemd, Unit: "web.service", Action: tc.action, Timeout: time.Second})
		n.Close()
		if (tc.want == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want %q", tc.action, err, tc.want)
		}
	}
	if got := strings.Join(calls, "; "); got != "reload web.service; restart web.service; reload-or-try-restart web.service" {
		t.Errorf("calls: %s", got)
	}
	if errors.Is(nil, context.Canceled) {
		t.Fatal("unreachable")
	}
}
