package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/daemon"
	"github.com/kvmount/kvmount/internal/embedetcd"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/internal/testlog"
)

const waitTimeout = 30 * time.Second

// kvmountBin is the daemon binary, built once by TestMain.
var kvmountBin string

func TestMain(m *testing.M) {
	// The commands run in this process start this binary again as their
	// worker.
	daemon.MaybeWorker(registry())
	dir, err := os.MkdirTemp("", "kvmount-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	kvmountBin = filepath.Join(dir, "kvmount")
	// The kvmount_crashtest tag adds two test hooks (projector's
	// KVMOUNT_TEST_SWITCH_PAUSE and KVMOUNT_TEST_MANIFEST_PAUSE), inert
	// unless those variables are set.
	build := exec.Command("go", "build", "-race", "-tags", "kvmount_crashtest", "-o", kvmountBin, ".")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building kvmount:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func runCmd(args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = run(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func writeFile(t *testing.T, name, body string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestCheck(t *testing.T) {
	valid := writeFile(t, "ok.toml", `
[sources.main]
type = "etcd"
endpoints = ["http://127.0.0.1:2379"]
peer_user = "root"

[[mount]]
name = "app"
dir = "/srv/app"
source = "main"
prefix = "/apps/app/"
`)
	code, out, errOut := runCmd("check", "-config", valid)
	if code != 0 || !strings.Contains(out, "OK (1 source, 1 mount, 0 warnings)") || errOut != "" {
		t.Errorf("check valid = %d, %q, %q; want 0 and OK", code, out, errOut)
	}
	// These machines' kernels offer Landlock (ABI 7) and seccomp.
	if !strings.Contains(out, "worker: the sources are read by unprivileged workers, one per trust domain (1), as ") ||
		!strings.Contains(out, "domain main (sources main; mounts app):") ||
		!regexp.MustCompile(`no capability, no_new_privs, Landlock ABI [1-9][0-9]* and a seccomp filter`).MatchString(out) {
		t.Errorf("check says nothing of the worker's confinement:\n%s", out)
	}
	for _, line := range []string{"seccomp: an allowlist of", "every other architecture's (the i386 entry), refused", "sockets: TCP (IPv4, IPv6; no MPTCP)",
		"connects over TCP only to ports [2379]", "signals and abstract unix sockets only within the worker", "not dumpable"} {
		if !strings.Contains(out, line) {
			t.Errorf("check does not say what is in force on this kernel (%q):\n%s", line, out)
		}
	}

	warned := writeFile(t, "warn.toml", `
[sources.main]
type = "etcd"

[[mount]]
name = "app"
dir = "/srv/app"
source = "main"
prefix = "/apps/app"
`)
	code, out, errOut = runCmd("check", "-config", warned)
	if code != 0 || !strings.Contains(out, "2 warnings)") || !strings.Contains(errOut, "warning: "+warned+`:9: mount[0].prefix: "/apps/app" does not end in "/"`) {
		t.Errorf("check with a prefix lacking \"/\" = %d, %q, %q; want 0 and a warning at line 9", code, out, errOut)
	}
	// The second review's tenth finding: plain TCP, even on loopback,
	// feeding a mount of root's.
	if !strings.Contains(errOut, "warning: "+warned+`:8: mount[0].source: mount app is root's, and source main feeds it over plain TCP (http://127.0.0.1:2379): a local user who takes that port`) {
		t.Errorf("check does not warn that plain TCP feeds a mount of root's:\n%s", errOut)
	}

	invalid := writeFile(t, "bad.toml", `
[sources.main]
type = "etcd"
endpoints = ["127.0.0.1:2379"]

[[mount]]
name = "app"
dir = "relative/dir"
source = "main"
prefx = "/apps/app/"

[[mount]]
name = "app"
dir = "/etc"
source = "nope"
medium = "ramdisk"
default_mode = "999"
`)
	code, out, errOut = runCmd("check", "-config", invalid)
	if code != 1 || out != "" {
		t.Errorf("check invalid = %d, stdout %q; want 1 and nothing", code, out)
	}
	for _, want := range []string{
		invalid + `:4: sources.main.endpoints: "127.0.0.1:2379": want a URL`,
		invalid + `:8: mount[0].dir: "relative/dir" is not an absolute path`,
		invalid + `:10: mount[0].prefx: unknown key (did you mean "prefix"?)`,
		invalid + `:13: mount[1].name: mount name "app" is already used by mount[0]`,
		invalid + `:14: mount[1].dir: "/etc" is a system directory`,
		invalid + `:15: mount[1].source: unknown source "nope"`,
		invalid + `:16: mount[1].medium: "ramdisk" is not one of disk, tmpfs`,
		invalid + `:17: mount[1].default_mode: bad mode "999"`,
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("check output lacks %q:\n%s", want, errOut)
		}
	}

	code, _, errOut = runCmd("check", "-config", filepath.Join(t.TempDir(), "missing.toml"))
	if code != 1 || !strings.Contains(errOut, "no such file") {
		t.Errorf("check missing = %d, %q", code, errOut)
	}
}

// TestCheckWarnsAboutExposedCredentialsAndPaths: kvmount check names every
// credential the configuration exposes — a token file others can read, a
// token sent over plain http to another host, a token in a URL, an inline
// Authorization header — and every path a local user could redirect — a
// mount directory under a directory a user owns, a symlink in a path —
// as warnings: the file stays valid. And it says how check commands see
// the version they check.
func TestCheckWarnsAboutExposedCredentialsAndPaths(t *testing.T) {
	u := roottest.NewUser(t)
	base := t.TempDir()
	token := filepath.Join(base, "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	app := filepath.Join(base, "srv", "app")
	if err := os.MkdirAll(app, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, app)
	if err := os.Symlink(filepath.Join(base, "srv"), filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	cfg := writeFile(t, "k.toml", fmt.Sprintf(`
state_dir = %q

[sources.consul]
type = "consul"
address = "http://consul.example.com:8500"
token_file = %q

[sources.web]
type = "http"
url = "https://config.example.com/app.json?access_token=abc"
headers = { Authorization = "Bearer inline" }

[[mount]]
name = "app"
dir = %q
source = "web"
prefix = "app/"
check_command = ["true"]

[[mount]]
name = "linked"
dir = %q
source = "consul"
prefix = "app/"
`, filepath.Join(base, "state"), token, filepath.Join(app, "etc", "certs"), filepath.Join(base, "link", "x")))
	code, out, errOut := runCmd("check", "-config", cfg)
	if code != 0 {
		t.Fatalf("check = %d, %q, %q; want 0: these are warnings", code, out, errOut)
	}
	for _, want := range []string{
		"sources.consul.token_file: " + token + " holds a credential and is readable by every user (mode 0644)",
		"sources.consul.address: credentials go to consul.example.com:8500 in clear text (http://)",
		"sources.web.url: https://config.example.com/app.json?access_token=redacted carries what may be credentials in its URL",
		"sources.web.headers: header Authorization holds a credential in the configuration file",
		"mount app: dir " + filepath.Join(app, "etc", "certs") + ": " + app + " is owned by user " + u.Name,
		"mount linked: dir: " + filepath.Join(base, "link", "x") + ": a symlink in the path: " + filepath.Join(base, "link") + " is a symlink",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("check's warnings lack %q:\n%s", want, errOut)
		}
	}
	if strings.Contains(errOut, "abc") || strings.Contains(errOut, "s3cret") {
		t.Errorf("a warning shows a credential:\n%s", errOut)
	}
	if !strings.Contains(out, "7 warnings") || !strings.Contains(out, "check_command: runs in a private mount namespace") {
		t.Errorf("check's summary: %q", out)
	}
}

func TestUsage(t *testing.T) {
	if code, _, errOut := runCmd(); code != 2 || !strings.Contains(errOut, "usage:") {
		t.Errorf("no command = %d, %q", code, errOut)
	}
	if code, _, errOut := runCmd("frobnicate"); code != 2 || !strings.Contains(errOut, `unknown command "frobnicate"`) {
		t.Errorf("unknown command = %d, %q", code, errOut)
	}
	if code, out, _ := runCmd("version"); code != 0 || !strings.HasPrefix(out, "kvmount ") {
		t.Errorf("version = %d, %q", code, out)
	}
	if code, _, _ := runCmd("check", "extra"); code != 2 {
		t.Errorf("extra argument = %d; want 2", code)
	}
}

// env is a real etcd and a configuration file pointing at it.
type env struct {
	t      *testing.T
	etcd   *embedetcd.Server
	cli    *clientv3.Client
	base   string
	config string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	// Reachable by other users: check commands run as nobody.
	base := roottest.TempDir(t)
	srv, cli := etcdtest.Start(t)
	return &env{t: t, etcd: srv, cli: cli, base: base, config: filepath.Join(base, "kvmount.toml")}
}

func (e *env) writeConfig(mounts ...string) {
	e.t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "state_dir = %q\n[admin]\naddress = \"\"\nsocket = %q\n[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n", filepath.Join(e.base, "state"), e.socket(), e.etcd.Endpoint())
	for _, m := range mounts {
		fmt.Fprintf(&b, "[[mount]]\nname = %q\ndir = %q\nsource = \"main\"\nprefix = \"/%s/\"\n", m, e.dir(m), m)
	}
	if err := os.WriteFile(e.config, []byte(b.String()), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) dir(mount string) string { return filepath.Join(e.base, "mnt", mount) }

// socket is the daemon's private admin socket, which kvmount status reads.
func (e *env) socket() string { return filepath.Join(e.base, "run", "kvmount.sock") }

func (e *env) put(key, value string) {
	e.t.Helper()
	etcdtest.Put(e.t, e.cli, key, value)
}

// start runs the kvmount binary.
func (e *env) start(args ...string) (*exec.Cmd, *testlog.Buffer) {
	e.t.Helper()
	return e.startEnv(nil, args...)
}

// startEnv runs the kvmount binary with extra environment variables.
func (e *env) startEnv(environ []string, args ...string) (*exec.Cmd, *testlog.Buffer) {
	e.t.Helper()
	return e.startIn(append(os.Environ(), environ...), args...)
}

// startIn runs the kvmount binary in the environment environ, and no
// other.
func (e *env) startIn(environ []string, args ...string) (*exec.Cmd, *testlog.Buffer) {
	e.t.Helper()
	logs := &testlog.Buffer{}
	cmd := exec.Command(kvmountBin, append(args, "-config", e.config)...)
	cmd.Env = environ
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return cmd, logs
}

// waitFile waits until path holds want.
func waitFile(t *testing.T, path, want string) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		got, err := os.ReadFile(path)
		if err == nil && string(got) == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s = %q, %v; want %q", path, got, err, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func waitGone(t *testing.T, path string) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		if _, err := os.Lstat(path); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still exists", path)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// checkOneVersion asserts that dir holds exactly one complete version and
// no leftovers of a write.
func checkOneVersion(t *testing.T, dir string) {
	t.Helper()
	list, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	target, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list {
		name := e.Name()
		switch {
		case name == "..data":
		case name == target:
		case strings.HasPrefix(name, ".."):
			t.Errorf("leftover %s in %s", name, dir)
		}
	}
}

// TestSIGTERMStopsCleanly stops the daemon during a stream of updates: it
// must exit 0 and leave exactly one complete version.
func TestSIGTERMStopsCleanly(t *testing.T) {
	e := newEnv(t)
	e.put("/app/n", "0")
	e.writeConfig("app")
	for round := range 3 {
		cmd, logs := e.start("run")
		waitFile(t, filepath.Join(e.dir("app"), "n"), fmt.Sprint(round*100))
		for i := 1; i <= 100; i++ {
			e.put("/app/n", fmt.Sprint(round*100+i))
			if i == 50 {
				if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("kvmount exited with %v after SIGTERM; logs:\n%s", err, logs)
		}
		if !strings.Contains(logs.String(), "kvmount stopped") {
			t.Errorf("no clean stop in the logs:\n%s", logs)
		}
		checkOneVersion(t, e.dir("app"))
	}
}

// TestSIGHUPAddsAndRemovesMounts reloads the real binary with SIGHUP.
func TestSIGHUPAddsAndRemovesMounts(t *testing.T) {
	e := newEnv(t)
	e.put("/one/a", "1")
	e.put("/two/b", "2")
	e.writeConfig("one")
	cmd, logs := e.start("run")
	waitFile(t, filepath.Join(e.dir("one"), "a"), "1")

	e.writeConfig("two")
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFile(t, filepath.Join(e.dir("two"), "b"), "2")
	waitGone(t, e.dir("one"))
	before, _ := os.Readlink(filepath.Join(e.dir("two"), "..data"))

	// Adding "one" back must leave "two", unchanged, as it is.
	e.writeConfig("one", "two")
	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitFile(t, filepath.Join(e.dir("one"), "a"), "1")
	after, _ := os.Readlink(filepath.Join(e.dir("two"), "..data"))
	if before == "" || after != before {
		t.Errorf("mount two: ..data -> %q before the reload, %q after; want the same version (not rewritten)", before, after)
	}
	e.put("/two/b", "3")
	waitFile(t, filepath.Join(e.dir("two"), "b"), "3")
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit %v; logs:\n%s", err, logs)
	}
}

func TestOnceExitCodes(t *testing.T) {
	e := newEnv(t)
	e.put("/app/a", "1")
	e.writeConfig("app")
	if code, _, errOut := runCmd("once", "-config", e.config); code != 0 {
		t.Fatalf("once = %d; stderr:\n%s", code, errOut)
	}
	waitFile(t, filepath.Join(e.dir("app"), "a"), "1")
	e.writeConfig("app", "missing")
	code, _, errOut := runCmd("once", "-config", e.config, "-timeout", "10s")
	if code != 1 || !strings.Contains(errOut, `missing: mount "missing": source "main": prefix "/missing/" does not exist`) {
		t.Errorf("once with a missing prefix = %d; stderr:\n%s", code, errOut)
	}
}

// credentialFile is a file an example names under /etc/kvmount in a line
// that is not a comment (a token, a CA).
var credentialFile = regexp.MustCompile(`(?m)^[^#\n]*"(/etc/kvmount/[^"]+)"`)

// TestExamplesAreValid checks every example configuration. The credential
// files an example names under /etc/kvmount (a Vault token, its CA) are
// stood in for by files of a temporary directory, root's and mode 0600, as
// an operator's would be.
func TestExamplesAreValid(t *testing.T) {
	files, err := filepath.Glob("../../examples/*.toml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		text := string(data)
		if found := credentialFile.FindAllStringSubmatch(text, -1); len(found) > 0 {
			dir := t.TempDir()
			for _, m := range found {
				stand := filepath.Join(dir, filepath.Base(m[1]))
				if err := os.WriteFile(stand, []byte("stand-in\n"), 0o600); err != nil {
					t.Fatal(err)
				}
				text = strings.ReplaceAll(text, `"`+m[1]+`"`, fmt.Sprintf("%q", stand))
			}
			f = filepath.Join(dir, filepath.Base(f))
			if err := os.WriteFile(f, []byte(text), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if code, out, errOut := runCmd("check", "-config", f); code != 0 {
			t.Errorf("%s: check = %d\n%s%s", f, code, out, errOut)
		}
	}
}

// TestRenderCommand prints a mount's payload without writing it.
func TestRenderCommand(t *testing.T) {
	e := newEnv(t)
	e.put("/app/a", "hello")
	e.put("/app/dir/b", "x")
	e.writeConfig("app")
	code, out, errOut := runCmd("render", "-config", e.config, "-mount", "app")
	if code != 0 || out != "0644        5 a\n0644        1 dir/b\n" {
		t.Errorf("render = %d %q %q", code, out, errOut)
	}
	// The sources were read by a confined worker, not by render itself.
	if !strings.Contains(errOut, `msg="worker confined"`) || !strings.Contains(errOut, "seccomp=true") {
		t.Errorf("render ran no confined worker:\n%s", errOut)
	}
	if code, out, _ := runCmd("render", "-config", e.config, "-mount", "app", "-path", "a"); code != 0 || out != "hello" {
		t.Errorf("render -path a = %d %q", code, out)
	}
	if code, _, errOut := runCmd("render", "-config", e.config, "-mount", "nope"); code != 1 || !strings.Contains(errOut, `no mount "nope"`) {
		t.Errorf("render of an unknown mount = %d %q", code, errOut)
	}
	if _, err := os.Stat(e.dir("app")); !os.IsNotExist(err) {
		t.Errorf("render touched the mount directory: %v", err)
	}
}

// openPTY returns a pseudo-terminal's two ends: what is written to the
// second reaches the first as a terminal shows it.
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return m, s
}

// TestOutsideTextNeverReachesATerminalRaw (issue 36, 11): kvmount render
// -path escapes a store writer's escape sequences on a terminal, and
// writes the file's bytes as they are when piped; kvmount check escapes a
// symlink target chosen by whoever can write a parent; the plain-TCP
// warning shows a URL's query credentials redacted.
func TestOutsideTextNeverReachesATerminalRaw(t *testing.T) {
	hostile := "x\x1b]0;PWNED\a\x1b[2Jy"
	e := newEnv(t)
	e.put("/app/a", hostile)
	e.writeConfig("app")
	m, s := openPTY(t)
	var errb bytes.Buffer
	if code := run(context.Background(), []string{"render", "-config", e.config, "-mount", "app", "-path", "a"}, s, &errb); code != 0 {
		t.Fatalf("render -path = %d: %s", code, errb.String())
	}
	s.Close()
	buf := make([]byte, 4096)
	n, _ := m.Read(buf)
	if got := string(buf[:n]); strings.ContainsAny(got, "\x1b\a") || !strings.Contains(got, `x\x1b]0;PWNED\a\x1b[2Jy`) {
		t.Errorf("render -path on a terminal wrote %q; want the escape sequences escaped", got)
	}
	if code, out, _ := runCmd("render", "-config", e.config, "-mount", "app", "-path", "a"); code != 0 || out != hostile {
		t.Errorf("render -path piped = %d %q; want the file's bytes", code, out)
	}

	// A parent of a mount directory, a symlink whose target is hostile.
	parent := filepath.Join(e.base, "links")
	if err := os.Mkdir(parent, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/x"+hostile, filepath.Join(parent, "to")); err != nil {
		t.Fatal(err)
	}
	cfg := writeFile(t, "esc.toml", fmt.Sprintf("state_dir = %q\n[sources.main]\ntype = \"http\"\nurl = \"http://127.0.0.1:1/app.json?access_token=s3cr3t\"\n[[mount]]\nname = \"m\"\ndir = %q\nsource = \"main\"\nprefix = \"\"\n",
		filepath.Join(e.base, "state2"), filepath.Join(parent, "to", "m")))
	_, out, errOut := runCmd("check", "-config", cfg)
	if strings.ContainsAny(out+errOut, "\x1b\a") {
		t.Errorf("kvmount check printed the symlink's target raw:\n%q", out+errOut)
	}
	if !strings.Contains(out+errOut, `\x1b`) {
		t.Errorf("kvmount check does not show the symlink's target escaped:\n%s", out+errOut)
	}
	if strings.Contains(out+errOut, "s3cr3t") || !strings.Contains(out+errOut, "access_token=redacted") {
		t.Errorf("kvmount check shows the URL's token, or not the URL redacted:\n%s", out+errOut)
	}
}
