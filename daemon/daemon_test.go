package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/roottest"
)

func TestPutUpdateDeletePropagate(t *testing.T) {
	h := newHarness(t)
	h.put("/apps/app/app.conf", "v1", "/apps/app/tls/cert.pem", "CERT", "/apps/other/x", "no")
	h.writeConfig(h.mount("app", "/apps/app/"))
	h.start()
	dir := h.path("mnt", "app")
	h.waitContent(dir, map[string]string{"app.conf": "v1", "tls/cert.pem": "CERT"})
	if got := entries(t, dir); len(got) != 4 || !slices.Contains(got, "app.conf") || !slices.Contains(got, "tls") {
		t.Errorf("mount dir holds %v; want ..data, one version, app.conf and tls", got)
	}
	h.put("/apps/app/app.conf", "v2")
	h.waitContent(dir, map[string]string{"app.conf": "v2", "tls/cert.pem": "CERT"})
	h.put("/apps/app/new.conf", "new")
	h.waitContent(dir, map[string]string{"app.conf": "v2", "tls/cert.pem": "CERT", "new.conf": "new"})
	h.put("/apps/app/tls/cert.pem", etcdtest.Delete)
	h.waitContent(dir, map[string]string{"app.conf": "v2", "new.conf": "new"})
	h.waitGone(filepath.Join(dir, "tls"))
	info, err := os.Stat(filepath.Join(dir, "app.conf"))
	if err != nil || info.Mode().Perm() != 0o644 {
		t.Errorf("app.conf mode = %v, %v; want 0644", info, err)
	}
	h.waitLog("projected", "mount=app", "added=0", "changed=0", "removed=1")
	if strings.Contains(h.logs.String(), "CERT") || strings.Contains(h.logs.String(), "v2") {
		t.Errorf("a value reached the logs")
	}
}

// TestTransactionIsOneSwitch checks that readers who resolve ..data once
// never see files of two revisions while multi-key transactions stream in.
func TestTransactionIsOneSwitch(t *testing.T) {
	h := newHarness(t)
	h.put("/tx/a", "0", "/tx/b", "0", "/tx/c", "0")
	h.writeConfig(h.mount("tx", "/tx/"))
	h.start()
	dir := h.path("mnt", "tx")
	h.waitContent(dir, map[string]string{"a": "0", "b": "0", "c": "0"})

	sameRevision := func(version string, values []string) {
		if values[0] != values[1] || values[1] != values[2] {
			t.Errorf("version %s mixes revisions: %v", version, values)
		}
	}
	stop1 := readVersions(t, dir, []string{"a", "b", "c"}, sameRevision)
	stop2 := readVersions(t, dir, []string{"a", "b", "c"}, sameRevision)
	const rounds = 300
	for i := 1; i <= rounds; i++ {
		v := fmt.Sprint(i)
		h.put("/tx/a", v, "/tx/b", v, "/tx/c", v)
	}
	final := fmt.Sprint(rounds)
	h.waitContent(dir, map[string]string{"a": final, "b": final, "c": final})
	if reads := stop1() + stop2(); reads < 100 {
		t.Errorf("only %d whole-version reads; the test did not exercise the switch", reads)
	} else {
		t.Logf("%d whole-version reads", reads)
	}
}

// TestCompactionRecovery cuts kvmount off from etcd, deletes and adds keys
// and compacts past them, then restores the network: the resumed watch meets
// ErrCompacted, and kvmount must re-read the prefix and find the deletion.
func TestCompactionRecovery(t *testing.T) {
	h := newHarness(t)
	proxy := h.proxyEtcd()
	h.put("/c/keep", "1", "/c/gone", "2")
	h.writeConfig(h.mount("c", "/c/"))
	h.start()
	dir := h.path("mnt", "c")
	h.waitContent(dir, map[string]string{"keep": "1", "gone": "2"})

	proxy.Cut()
	h.put("/c/gone", etcdtest.Delete)
	h.put("/c/new", "3")
	resp, err := h.cli.Get(context.Background(), "/c/keep")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.cli.Compact(context.Background(), resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	if got, _ := content(dir); got["gone"] != "2" {
		t.Fatalf("mount changed while cut off: %v", got)
	}
	if err := proxy.Restore(); err != nil {
		t.Fatal(err)
	}
	h.waitContent(dir, map[string]string{"keep": "1", "new": "3"})
	h.waitLog("re-reading", "compacted")
	h.put("/c/after", "4")
	h.waitContent(dir, map[string]string{"keep": "1", "new": "3", "after": "4"})
}

// TestEtcdRestart stops etcd while kvmount runs: the files keep their
// content, the mount is reported stale, kvmount keeps running, and writes
// made after etcd is back reach the files.
func TestEtcdRestart(t *testing.T) {
	h := newHarness(t)
	h.put("/r/a", "1")
	h.writeConfig(h.mount("r", "/r/"))
	h.start()
	dir := h.path("mnt", "r")
	version := h.waitContent(dir, map[string]string{"a": "1"})
	h.etcd.Stop()
	h.waitLog("mount stale", "mount=r")
	if got, v := content(dir); got["a"] != "1" || v != version {
		t.Fatalf("mount changed during the outage: %v at %s", got, v)
	}
	if err := h.etcd.Restart(); err != nil {
		t.Fatal(err)
	}
	h.waitLog("mount current", "mount=r")
	h.put("/r/a", "2")
	h.waitContent(dir, map[string]string{"a": "2"})
	select {
	case err := <-h.done:
		t.Fatalf("daemon exited during the outage: %v", err)
	default:
	}
}

// TestRestartWithoutRewriting restarts kvmount: unchanged mounts are
// adopted — same ..data target, same files — and nothing is logged as
// projected; a mount removed from the configuration meanwhile is torn down.
func TestRestartWithoutRewriting(t *testing.T) {
	h := newHarness(t)
	h.put("/k/a", "1", "/k/dir/b", "2", "/gone/x", "x")
	h.writeConfig(h.mount("keep", "/k/") + h.mount("gone", "/gone/"))
	h.start()
	keep, gone := h.path("mnt", "keep"), h.path("mnt", "gone")
	version := h.waitContent(keep, map[string]string{"a": "1", "dir/b": "2"})
	h.waitContent(gone, map[string]string{"x": "x"})
	before, err := os.Stat(filepath.Join(keep, "a"))
	if err != nil {
		t.Fatal(err)
	}
	h.waitReady()
	h.stop()

	h.writeConfig(h.mount("keep", "/k/"))
	projected := h.logs.Count("projected")
	h.start()
	h.waitReady()
	h.waitGone(gone)
	if _, v := content(keep); v != version {
		t.Errorf("..data points at %s after restart; want %s (adopted, not rewritten)", v, version)
	}
	after, err := os.Stat(filepath.Join(keep, "a"))
	if err != nil {
		t.Fatal(err)
	}
	if !os.SameFile(before, after) || !after.ModTime().Equal(before.ModTime()) {
		t.Errorf("file a was rewritten by the restart")
	}
	if n := h.logs.Count("projected"); n != projected {
		t.Errorf("restart projected %d times; want 0", n-projected)
	}
	h.put("/k/a", "changed")
	h.waitContent(keep, map[string]string{"a": "changed", "dir/b": "2"})
}

// TestBadKeys puts keys that would leave the mount: each is reported once,
// naming source, key and mount, and the rest of the mount keeps updating.
func TestBadKeys(t *testing.T) {
	h := newHarness(t)
	long := strings.Repeat("x", 300)
	h.put("/b/good", "1", "/b/../escape", "x", "/b/..data", "x", "/b/nul\x00key", "x", "/b/"+long, "x", "/b/a/../../up", "x")
	h.writeConfig(h.mount("b", "/b/"))
	h.start()
	dir := h.path("mnt", "b")
	h.waitContent(dir, map[string]string{"good": "1"})
	for _, key := range []string{`/b/../escape`, `/b/..data`, `/b/nul\x00key`, `/b/a/../../up`, `/b/` + long} {
		h.waitLog("rejected key", `source=main`, `mount=b`, key)
	}
	h.put("/b/good", "2", "/b/also", "3")
	h.waitContent(dir, map[string]string{"good": "2", "also": "3"})
	if n := h.logs.Count("rejected key", "/b/../escape"); n != 1 {
		t.Errorf("the bad key was reported %d times; want once", n)
	}
	for _, outside := range []string{h.path("mnt", "escape"), h.path("escape"), h.path("up"), h.path("mnt", "up")} {
		if _, err := os.Lstat(outside); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s exists: a key escaped the mount", outside)
		}
	}
}

// TestReload adds and removes mounts with SIGHUP; an unchanged mount is not
// touched, and an invalid configuration leaves the running one in force.
func TestReload(t *testing.T) {
	h := newHarness(t)
	h.put("/one/a", "1", "/two/b", "2", "/three/c", "3")
	h.writeConfig(h.mount("one", "/one/") + h.mount("two", "/two/"))
	h.start()
	one, two, three := h.path("mnt", "one"), h.path("mnt", "two"), h.path("mnt", "three")
	v1 := h.waitContent(one, map[string]string{"a": "1"})
	h.waitContent(two, map[string]string{"b": "2"})

	h.writeConfig(h.mount("one", "/one/") + h.mount("three", "/three/"))
	h.sighup()
	h.waitContent(three, map[string]string{"c": "3"})
	h.waitGone(two)
	if _, v := content(one); v != v1 {
		t.Errorf("unchanged mount one was rewritten: %s, was %s", v, v1)
	}
	if n := h.logs.Count("projected", "mount=one"); n != 1 {
		t.Errorf("mount one projected %d times; want once", n)
	}
	h.waitLog("torn down", "mount=two")

	if err := os.WriteFile(h.config, []byte("[[mount]]\nname = \"broken\"\nprefx = 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.sighup()
	h.waitLog("invalid configuration; the running one stays in force", "prefx")
	h.put("/three/c", "still followed")
	h.waitContent(three, map[string]string{"c": "still followed"})
	if got, _ := content(one); got["a"] != "1" {
		t.Errorf("mount one lost its content: %v", got)
	}
}

// TestDriftIsRepaired removes a file, a visible symlink and ..data by hand;
// the resync puts them back. The monitor holds no payload once written
// (reconcile.Releaser): the repair asks the worker for it again.
func TestDriftIsRepaired(t *testing.T) {
	h := newHarness(t)
	h.put("/d/a", "1", "/d/sub/b", "2")
	h.writeConfig(h.mount("d", "/d/"))
	h.start()
	dir := h.path("mnt", "d")
	want := map[string]string{"a": "1", "sub/b": "2"}
	h.waitContent(dir, want)
	for _, victim := range []string{"a", "..data", "sub/b", "sub"} {
		target := filepath.Join(dir, victim)
		if victim == "sub/b" {
			target = filepath.Join(dir, "..data", "sub", "b")
		}
		if err := os.Remove(target); err != nil {
			t.Fatalf("remove %s: %v", victim, err)
		}
		h.waitContent(dir, want)
		if _, err := os.Lstat(filepath.Join(dir, "a")); err != nil {
			t.Fatalf("after removing %s: %v", victim, err)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	h.waitContent(dir, want)
	h.waitLog("drift found; asking for the payload again to repair it", "mount=d")
	h.waitLog("repaired drift", "mount=d")
}

// TestForeignDirectoryIsRefused points a mount at a directory holding
// someone else's file: kvmount must not touch it.
func TestForeignDirectoryIsRefused(t *testing.T) {
	h := newHarness(t)
	dir := h.path("mnt", "f")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "precious.conf"), []byte("mine"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.put("/f/a", "1")
	h.writeConfig(h.mount("f", "/f/"))
	h.start()
	h.waitLog("operation failed", "mount=f", "kvmount did not write", "precious.conf")
	if got := entries(t, dir); len(got) != 1 || got[0] != "precious.conf" {
		t.Errorf("foreign directory now holds %v", got)
	}
}

func TestOnce(t *testing.T) {
	h := newHarness(t)
	h.put("/o/a", "1")
	h.writeConfig(h.mount("ok", "/o/") + h.mount("opt", "/missing/", "optional = true"))
	if err := Once(context.Background(), h.options(), waitTimeout); err != nil {
		t.Fatalf("Once = %v", err)
	}
	h.waitContent(h.path("mnt", "ok"), map[string]string{"a": "1"})
	if got, _ := content(h.path("mnt", "opt")); len(got) != 0 {
		t.Errorf("optional mount holds %v; want nothing", got)
	}

	h.writeConfig(h.mount("ok", "/o/") + h.mount("bad", "/missing/"))
	err := Once(context.Background(), h.options(), waitTimeout)
	var oe *OnceError
	if !errors.As(err, &oe) || !strings.Contains(oe.Failed["bad"], `prefix "/missing/" does not exist`) || len(oe.Failed) != 1 {
		t.Fatalf("Once = %v; want mount bad reported missing", err)
	}
}

func TestOnceWithEtcdDown(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("down", "/o/"))
	h.etcd.Stop()
	start := time.Now()
	err := Once(context.Background(), h.options(), waitTimeout)
	var oe *OnceError
	if !errors.As(err, &oe) || !strings.Contains(oe.Failed["down"], "unreachable") {
		t.Fatalf("Once = %v; want mount down reported unreachable", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("Once took %v to give up on an unreachable etcd; want about the dial timeout", d)
	}
}

// TestOwnersAndModes projects with a numeric user and group, a default mode
// and an item mode: files, directories and visible symlinks get them.
func TestOwnersAndModes(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	h.put("/own/a", "1", "/own/dir/b", "2", "/own/secret", "s")
	h.writeConfig(h.mount("own", "/own/", `user = "1234"`, `group = "5678"`, `default_mode = "0640"`,
		"[[mount.items]]\nkey = \"a\"\npath = \"a\"\n[[mount.items]]\nkey = \"dir/b\"\npath = \"dir/b\"\n[[mount.items]]\nkey = \"secret\"\npath = \"secret\"\nmode = \"0400\""))
	h.start()
	dir := h.path("mnt", "own")
	h.waitContent(dir, map[string]string{"a": "1", "dir/b": "2", "secret": "s"})
	for path, mode := range map[string]os.FileMode{"a": 0o640, "dir/b": 0o640, "secret": 0o400} {
		info, err := os.Stat(filepath.Join(dir, path))
		if err != nil {
			t.Fatal(err)
		}
		st := info.Sys().(*syscall.Stat_t)
		if info.Mode().Perm() != mode || st.Uid != 1234 || st.Gid != 5678 {
			t.Errorf("%s: mode %v owner %d:%d; want %v 1234:5678", path, info.Mode().Perm(), st.Uid, st.Gid, mode)
		}
	}
	version, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{".", "..data", version, version + "/dir", "dir", "a"} {
		info, err := os.Lstat(filepath.Join(dir, path))
		if err != nil {
			t.Fatal(err)
		}
		if st := info.Sys().(*syscall.Stat_t); st.Uid != 1234 || st.Gid != 5678 {
			t.Errorf("%s owned by %d:%d; want 1234:5678", path, st.Uid, st.Gid)
		}
	}
}

// TestConsulAgentRestartWithDataGone restarts a -dev Consul agent, which
// comes back empty with its indexes reset: the mount keeps its content
// while the prefix is missing, and writes made after the restart reach the
// files.
func TestConsulAgentRestartWithDataGone(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	for i := range 20 {
		consultest.Txn(t, client, "cr/a", fmt.Sprint(i)) // raise the index
	}
	h := newBareHarness(t)
	h.sources = func() string { return fmt.Sprintf("[sources.main]\ntype = \"consul\"\naddress = %q\n", agent.URL()) }
	h.writeConfig(h.mount("cr", "cr/"))
	h.start()
	dir := h.path("mnt", "cr")
	h.waitContent(dir, map[string]string{"a": "19"})
	agent.Stop()
	h.waitLog("mount stale", "mount=cr")
	if err := agent.Restart(); err != nil {
		t.Fatal(err)
	}
	h.waitLog("cannot build mount payload", "mount=cr", "does not exist")
	if got, _ := content(dir); got["a"] != "19" {
		t.Fatalf("mount lost its content when the agent came back empty: %v", got)
	}
	consultest.Txn(t, client, "cr/a", "after restart", "cr/b", "new")
	h.waitContent(dir, map[string]string{"a": "after restart", "b": "new"})
}

// TestReloadRereadsSecretFiles changes a header file and reloads: the new
// value is sent, and never logged.
func TestReloadRereadsSecretFiles(t *testing.T) {
	var seen atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Store(r.Header.Get("Authorization"))
		fmt.Fprint(w, `{"a": "1"}`)
	}))
	defer srv.Close()
	h := newBareHarness(t)
	tokenFile := h.path("token")
	if err := os.WriteFile(tokenFile, []byte("Bearer first-s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.sources = func() string {
		return fmt.Sprintf("[sources.main]\ntype = \"http\"\nurl = %q\npoll_interval = \"100ms\"\nheader_files = { Authorization = %q }\n", srv.URL, tokenFile)
	}
	h.writeConfig(h.mount("m", ""))
	h.start()
	h.waitContent(h.path("mnt", "m"), map[string]string{"a": "1"})
	if seen.Load() != "Bearer first-s3cret" {
		t.Fatalf("Authorization = %q", seen.Load())
	}
	if err := os.WriteFile(tokenFile, []byte("Bearer second-s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.sighup()
	deadline := time.Now().Add(waitTimeout)
	for seen.Load() != "Bearer second-s3cret" {
		if time.Now().After(deadline) {
			t.Fatalf("after reload Authorization = %q", seen.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if strings.Contains(h.logs.String(), "s3cret") {
		t.Errorf("a secret reached the logs")
	}
}
