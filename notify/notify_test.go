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
	"github.com/kvmount/kvmount/internal/roottest"
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
// errors; a file's content is never quoted.
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
	n := New(Options{Log: discard})
	defer n.Close()
	for file, want := range map[string]string{
		"missing": "no such file",
		"one":     "names PID 1; refusing to signal it",
		"dead":    "is not running",
		"junk":    "does not hold a process ID",
	} {
		err := n.sendSignal(context.Background(), config.Notify{Kind: config.NotifySignal, Signal: syscall.SIGHUP, PIDFile: filepath.Join(dir, file)})
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "nginx") {
			t.Errorf("pid file %s: %v; want %q", file, err, want)
		}
	}
}

// TestHostilePIDFiles plays the review's third finding as a real
// unprivileged user who writes the PID file: a symlink to a root-only file
// (whose content must never reach an error), a PID file naming a root
// process, a FIFO, /dev/zero and a huge file are all refused — nothing is
// signalled, nothing blocks, nothing grows — and a PID file the user owns
// is accepted only for a process in the named unit's control group.
func TestHostilePIDFiles(t *testing.T) {
	u := roottest.NewUser(t)
	dir := filepath.Join(roottest.TempDir(t), "run")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, dir)
	secret := filepath.Join(roottest.TempDir(t), "shadow")
	if err := os.WriteFile(secret, []byte("12345 root:$6$hash\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A root process the user would like kvmount to kill.
	victim := exec.Command("sleep", "60")
	if err := victim.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { victim.Process.Kill(); victim.Wait() })
	pid := fmt.Sprint(victim.Process.Pid)
	u.Run(t, "cd "+dir+" && ln -s "+secret+" link.pid && echo "+pid+" > root.pid && mkfifo fifo.pid && ln -s /dev/zero zero.pid && head -c 100000 /dev/zero | tr '\\0' 7 > huge.pid")
	// A hard link to a root-owned file is no way around the owner check.
	if err := os.WriteFile(filepath.Join(dir, "..", "root-owned.pid"), []byte(pid+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(dir, "..", "root-owned.pid"), filepath.Join(dir, "linked.pid")); err != nil {
		t.Fatal(err)
	}
	cgroup := testCgroup(t)
	n := New(Options{Log: discard, SystemdConn: fakeConnector{fakeManager{calls: new([]string), result: "done", cgroups: map[string]string{"web.service": cgroup}}}})
	defer n.Close()
	for _, tt := range []struct{ file, unit, want string }{
		{"link.pid", "", "a symlink"},
		{"root.pid", "", "is owned by uid"},
		{"root.pid", "web.service", "is not a process of unit web.service"},
		{"fifo.pid", "", "not a regular file"},
		{"zero.pid", "", "a symlink"},
		{"huge.pid", "", "more than 32 bytes"},
		{"linked.pid", "", "has 2 links"},
	} {
		done := make(chan error, 1)
		go func() {
			done <- n.sendSignal(context.Background(), config.Notify{Kind: config.NotifySignal, Signal: syscall.SIGTERM, PIDFile: filepath.Join(dir, tt.file), PIDUnit: tt.unit})
		}()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("%s (unit %q): %v; want an error with %q", tt.file, tt.unit, err, tt.want)
			}
			if err != nil && (strings.Contains(err.Error(), "root:$6$") || strings.Contains(err.Error(), "12345")) {
				t.Errorf("%s: the error quotes the file's content: %v", tt.file, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: sendSignal blocked", tt.file)
		}
	}
	if victim.ProcessState != nil || victim.Process.Signal(syscall.Signal(0)) != nil {
		t.Fatal("the root process was signalled")
	}
	// The unit's own process, named in a PID file its user writes: signalled.
	child := exec.Command("sh", "-c", "trap 'exit 0' HUP; while :; do sleep 0.05; done")
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer child.Process.Kill()
	if err := os.WriteFile(filepath.Join(cgroupRoot(t), cgroup, "cgroup.procs"), []byte(fmt.Sprint(child.Process.Pid)), 0o644); err != nil {
		t.Fatal(err)
	}
	u.Run(t, "echo "+fmt.Sprint(child.Process.Pid)+" > "+filepath.Join(dir, "web.pid"))
	if err := n.sendSignal(context.Background(), config.Notify{Kind: config.NotifySignal, Signal: syscall.SIGHUP, PIDFile: filepath.Join(dir, "web.pid"), PIDUnit: "web.service"}); err != nil {
		t.Fatalf("the unit's own process: %v", err)
	}
	if err := child.Wait(); err != nil {
		t.Errorf("the unit's process did not exit on SIGHUP: %v", err)
	}
}

// cgroupRoot returns where the cgroup v2 hierarchy is mounted.
func cgroupRoot(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if _, rest, ok := strings.Cut(line, " - "); ok && strings.HasPrefix(rest, "cgroup2 ") {
			return strings.Fields(line)[4]
		}
	}
	t.Fatal("no cgroup2 hierarchy is mounted")
	return ""
}

// testCgroup makes a control group for the test's "unit" and returns its
// path in the hierarchy; it is removed when the test ends.
func testCgroup(t *testing.T) string {
	t.Helper()
	roottest.Require(t)
	name := fmt.Sprintf("/kvmount-test-%d", os.Getpid())
	path := filepath.Join(cgroupRoot(t), name)
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for deadline := time.Now().Add(waitTimeout); os.Remove(path) != nil; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Errorf("cannot remove the control group %s", path)
				return
			}
		}
	})
	return name
}

// TestWebhookRedirects: a redirect within the webhook's own origin is
// followed with the configured headers, which may hold credentials; one to
// another origin — another host (the review saw a 307 there receive
// X-Hook-Token), or https to http — is refused and sends nothing there.
func TestWebhookRedirects(t *testing.T) {
	type hit struct{ token, auth string }
	var mu sync.Mutex
	hits := map[string][]hit{}
	record := func(name string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			hits[name] = append(hits[name], hit{r.Header.Get("X-Hook-Token"), r.Header.Get("Authorization")})
			mu.Unlock()
		}
	}
	other := httptest.NewServer(record("other"))
	defer other.Close()
	plain := httptest.NewServer(record("plain"))
	defer plain.Close()
	var same *httptest.Server
	same = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/to-other":
			http.Redirect(w, r, other.URL+"/hook", http.StatusTemporaryRedirect)
		case "/to-self":
			http.Redirect(w, r, same.URL+"/final", http.StatusTemporaryRedirect)
		default:
			record("same")(w, r)
		}
	}))
	defer same.Close()
	secure := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, plain.URL+"/hook", http.StatusTemporaryRedirect)
	}))
	defer secure.Close()
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sec, err := config.Parse("k.toml", []byte(fmt.Sprintf(`
[sources.s]
type = "x"
[[mount]]
name = "m"
dir = "/srv/m"
source = "s"
prefix = "p/"
  [[mount.notify]]
  webhook = "http://unused/"
  headers = { Authorization = "Bearer inline" }
  header_files = { X-Hook-Token = %q }
`, token)), map[string]config.SourceDecoder{"x": func(*config.Section) any { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	e := sec.Mounts[0].Notify[0]
	n := New(Options{Log: discard, HTTPClient: secure.Client()})
	defer n.Close()
	e.Webhook = same.URL + "/to-self"
	if err := n.postWebhook(context.Background(), e, change("m", "v1")); err != nil {
		t.Fatalf("to self: %v", err)
	}
	for _, url := range []string{same.URL + "/to-other", secure.URL + "/hook"} {
		e.Webhook = url
		if err := n.postWebhook(context.Background(), e, change("m", "v1")); err == nil || !strings.Contains(err.Error(), "redirected to another origin") {
			t.Errorf("%s: %v; want refused as another origin", url, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if got := hits["other"]; len(got) != 0 {
		t.Errorf("the other origin got %+v; want nothing", got)
	}
	if got := hits["same"]; len(got) != 1 || got[0] != (hit{"s3cret", "Bearer inline"}) {
		t.Errorf("the webhook's own origin got %+v; want the configured headers", got)
	}
	if got := hits["plain"]; len(got) != 0 {
		t.Errorf("the http server got %+v after a redirect from https", got)
	}
}

// TestFailingEntryNeverStorms: a failing entry keeps its backoff however
// many newer versions arrive — the review saw 316 runs in 3 s once a newer
// version had superseded one.
func TestFailingEntryNeverStorms(t *testing.T) {
	runs := filepath.Join(t.TempDir(), "runs")
	n, r := start(t, "app", config.Notify{Kind: config.NotifyCommand, Command: []string{"sh", "-c", "echo x >> " + runs + "; exit 1"}, Timeout: 5 * time.Second})
	n.Notify(change("app", "v0"))
	r.waitFor(t, "a first failure", func(rs []Result) bool { return len(rs) == 1 })
	stop := time.Now().Add(3500 * time.Millisecond)
	for i := 1; time.Now().Before(stop); i++ {
		n.Notify(change("app", fmt.Sprintf("v%d", i)))
		time.Sleep(10 * time.Millisecond)
	}
	data, _ := os.ReadFile(runs)
	// Attempts at 0, 1 s, 3 s: three within 3.5 s, and never closer
	// together than the backoff.
	if got := strings.Count(string(data), "x"); got > 3 {
		t.Errorf("%d runs in 3.5 s; want at most 3 (backoff 1 s, then 2 s)", got)
	}
	rs := r.all()
	for i := 1; i < len(rs); i++ {
		if gap := rs[i].Time.Sub(rs[i-1].Time); gap < RetryMin-50*time.Millisecond {
			t.Errorf("attempts %d and %d only %v apart", i, i+1, gap)
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
	calls   *[]string
	result  string
	cgroups map[string]string // unit → control group
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
func (f fakeManager) ControlGroup(_ context.Context, unit string) (string, error) {
	return f.cgroups[unit], nil
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
