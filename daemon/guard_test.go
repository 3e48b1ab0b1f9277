package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/roottest"
)

func TestTmpfsMedium(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	dir := h.path("mnt", "secrets")
	roottest.UnmountAtEnd(t, dir)
	h.put("/s/db-password", "hunter2", "/s/tls/key.pem", "KEY")
	tmpfs := h.mount("secrets", "/s/", `medium = "tmpfs"`, `size_limit = "64KiB"`, `default_mode = "0400"`, `dir_mode = "0750"`, `user = "1234"`, `group = "5678"`)
	h.writeConfig(tmpfs)
	h.start()
	version := h.waitContent(dir, map[string]string{"db-password": "hunter2", "tls/key.pem": "KEY"})
	if st, err := fsutil.MountStateOf(dir); st != fsutil.OwnTmpfs || err != nil {
		t.Fatalf("MountStateOf = %v, %v; want kvmount's tmpfs", st, err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	if size := int64(sfs.Blocks) * sfs.Bsize; size != 64<<10 {
		t.Errorf("tmpfs size %d; want 64 KiB", size)
	}
	if sfs.Flags&unix.ST_NOSUID == 0 || sfs.Flags&unix.ST_NODEV == 0 || sfs.Flags&unix.ST_NOEXEC == 0 {
		t.Errorf("mount flags %#x; want nosuid, nodev, noexec", sfs.Flags)
	}
	for path, mode := range map[string]os.FileMode{".": 0o750, "..data/tls": 0o750, "db-password": 0o400, "tls/key.pem": 0o400} {
		info, err := os.Stat(filepath.Join(dir, path))
		if err != nil {
			t.Fatal(err)
		}
		st := info.Sys().(*syscall.Stat_t)
		if info.Mode().Perm() != mode || st.Uid != 1234 || st.Gid != 5678 {
			t.Errorf("%s: mode %v owner %d:%d; want %v 1234:5678", path, info.Mode().Perm(), st.Uid, st.Gid, mode)
		}
	}

	// A payload larger than the tmpfs is refused; the content stays.
	h.put("/s/huge", strings.Repeat("x", 100<<10))
	h.waitLog("operation failed", "mount=secrets", "more than size_limit")
	if got, v := content(dir); got["db-password"] != "hunter2" || v != version || len(got) != 2 {
		t.Errorf("content after the refused payload: %v at %s", summary(got), v)
	}
	h.put("/s/huge", etcdtest.Delete)
	h.waitContent(dir, map[string]string{"db-password": "hunter2", "tls/key.pem": "KEY"})
	version, _ = os.Readlink(filepath.Join(dir, "..data"))

	// A restart adopts the tmpfs: no second mount, nothing rewritten.
	h.stop()
	h.start()
	h.waitReady()
	if n := roottest.MountsAt(t, dir); n != 1 {
		t.Errorf("%d mounts at %s after restart; want 1", n, dir)
	}
	if _, v := content(dir); v != version {
		t.Errorf("..data points at %s after restart; want %s", v, version)
	}

	// Removing the mount unmounts the tmpfs and removes the directory.
	h.writeConfig(h.mount("other", "/s/"))
	h.sighup()
	h.waitGone(dir)
	if n := roottest.MountsAt(t, dir); n != 0 {
		t.Errorf("%d mounts left at %s after teardown", n, dir)
	}
}

// TestModeAndOwnerOnlyChanges changes only default_mode, then only the
// owner, by reload: the files follow without a change of content.
func TestModeAndOwnerOnlyChanges(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	h.put("/mo/a", "1")
	h.writeConfig(h.mount("mo", "/mo/"))
	h.start()
	dir := h.path("mnt", "mo")
	h.waitContent(dir, map[string]string{"a": "1"})
	stat := func() (os.FileMode, uint32) {
		info, err := os.Stat(filepath.Join(dir, "a"))
		if err != nil {
			t.Fatal(err)
		}
		return info.Mode().Perm(), info.Sys().(*syscall.Stat_t).Uid
	}
	waitFor := func(what string, ok func() bool) {
		deadline := time.Now().Add(waitTimeout)
		for !ok() {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	h.writeConfig(h.mount("mo", "/mo/", `default_mode = "0600"`))
	h.sighup()
	waitFor("mode 0600", func() bool { m, _ := stat(); return m == 0o600 })
	h.waitLog("projected", "mount=mo", "changed=1")
	h.writeConfig(h.mount("mo", "/mo/", `default_mode = "0600"`, `user = "4321"`))
	h.sighup()
	waitFor("owner 4321", func() bool { _, uid := stat(); return uid == 4321 })
	if got, _ := content(dir); got["a"] != "1" {
		t.Errorf("content changed: %v", got)
	}
}

// TestGuardRails holds back an empty payload over a non-empty mount and a
// payload under min_keys, and lets allow_empty empty a mount.
func TestGuardRails(t *testing.T) {
	h := newHarness(t)
	h.put("/e/a", "1", "/e/b", "2", "/ae/a", "1", "/mk/a", "1", "/mk/b", "2", "/mk/c", "3")
	h.writeConfig(h.mount("empty", "/e/", "optional = true") +
		h.mount("allowed", "/ae/", "optional = true", "allow_empty = true") +
		h.mount("minkeys", "/mk/", "min_keys = 3"))
	h.start()
	h.waitContent(h.path("mnt", "empty"), map[string]string{"a": "1", "b": "2"})
	h.waitContent(h.path("mnt", "allowed"), map[string]string{"a": "1"})
	h.waitContent(h.path("mnt", "minkeys"), map[string]string{"a": "1", "b": "2", "c": "3"})

	h.put("/e/a", etcdtest.Delete, "/e/b", etcdtest.Delete, "/ae/a", etcdtest.Delete, "/mk/c", etcdtest.Delete)
	h.waitContent(h.path("mnt", "allowed"), map[string]string{})
	h.waitLog("update held back", "mount=empty", "an empty payload would replace 2 files")
	h.waitLog("update held back", "mount=minkeys", "fewer than min_keys (3)")
	if got, _ := content(h.path("mnt", "empty")); len(got) != 2 {
		t.Errorf("empty snapshot replaced the mount: %v", got)
	}
	if got, _ := content(h.path("mnt", "minkeys")); len(got) != 3 {
		t.Errorf("min_keys let a smaller payload through: %v", got)
	}
	h.put("/e/c", "3", "/mk/d", "4")
	h.waitContent(h.path("mnt", "empty"), map[string]string{"c": "3"})
	h.waitContent(h.path("mnt", "minkeys"), map[string]string{"a": "1", "b": "2", "d": "4"})
}

func TestImmutable(t *testing.T) {
	h := newHarness(t)
	h.put("/im/a", "1")
	h.writeConfig(h.mount("im", "/im/", "immutable = true"))
	h.start()
	dir := h.path("mnt", "im")
	h.waitContent(dir, map[string]string{"a": "1"})
	h.waitLog("immutable mount has its payload; no longer following its sources", "mount=im")
	h.put("/im/a", "2")
	h.put("/other/x", "settle") // a later write, so that the first had time to arrive
	time.Sleep(200 * time.Millisecond)
	if got, _ := content(dir); got["a"] != "1" {
		t.Errorf("immutable mount changed: %v", got)
	}
	// A restart reads it again.
	h.stop()
	h.start()
	h.waitContent(dir, map[string]string{"a": "2"})
}

func TestCheckCommand(t *testing.T) {
	h := newHarness(t)
	h.put("/cc/app.conf", "valid 1")
	h.writeConfig(h.mount("cc", "/cc/", `check_command = ["sh", "-c", "grep -q valid {{dir}}/app.conf || { echo 'app.conf: no valid line' >&2; exit 3; }"]`, `check_timeout = "5s"`))
	h.start()
	dir := h.path("mnt", "cc")
	h.waitContent(dir, map[string]string{"app.conf": "valid 1"})
	h.put("/cc/app.conf", "broken")
	h.waitLog("operation failed", "mount=cc", "check_command sh: exit status 3", "app.conf: no valid line")
	if got, _ := content(dir); got["app.conf"] != "valid 1" {
		t.Errorf("a refused version reached the mount: %v", got)
	}
	h.put("/cc/app.conf", "valid 2")
	h.waitContent(dir, map[string]string{"app.conf": "valid 2"})
}

func TestCheckCommandTimeout(t *testing.T) {
	h := newHarness(t)
	h.put("/ct/a", "1")
	h.writeConfig(h.mount("ct", "/ct/", `check_command = ["sleep", "10"]`, `check_timeout = "200ms"`))
	h.start()
	h.waitLog("operation failed", "mount=ct", "timed out after 200ms")
	if _, err := os.Lstat(filepath.Join(h.path("mnt", "ct"), "a")); !os.IsNotExist(err) {
		t.Errorf("a version whose check timed out is visible: %v", err)
	}
}

func TestSizeLimits(t *testing.T) {
	h := newHarness(t)
	h.put("/sz/a", "small", "/ms/a", "12345", "/ms/b", "12345")
	h.writeConfig(h.mount("sz", "/sz/", `max_value_size = "8B"`) + h.mount("ms", "/ms/", `max_mount_size = "12B"`))
	h.start()
	h.waitContent(h.path("mnt", "sz"), map[string]string{"a": "small"})
	h.waitContent(h.path("mnt", "ms"), map[string]string{"a": "12345", "b": "12345"})
	h.put("/sz/a", "too large!", "/ms/c", "12345")
	h.waitLog("cannot build mount payload", `mount=sz`, `source \"main\" key \"/sz/a\": value of 10 bytes exceeds max_value_size (8 bytes)`)
	h.waitLog("cannot build mount payload", `mount=ms`, `payload of 15 bytes exceeds max_mount_size (12 bytes)`)
	if got, _ := content(h.path("mnt", "sz")); got["a"] != "small" {
		t.Errorf("a value over max_value_size replaced the content: %v", got)
	}
	if got, _ := content(h.path("mnt", "ms")); len(got) != 2 {
		t.Errorf("a payload over max_mount_size replaced the content: %v", got)
	}
	h.put("/sz/a", "fits", "/ms/c", etcdtest.Delete)
	h.waitContent(h.path("mnt", "sz"), map[string]string{"a": "fits"})
}

// TestProjectedMountWithOneSourceDown projects an etcd prefix and an HTTP
// document into one directory: both switch together, and while etcd is cut
// off the mount keeps etcd's part and follows the HTTP one.
func TestProjectedMountWithOneSourceDown(t *testing.T) {
	h := newHarness(t)
	proxy := h.proxyEtcd()
	web := newHTTPBackend(t)
	web.put(t, "flags/dark-mode", "off")
	h.put("/p/app.conf", "listen 80")
	h.sources = func() string {
		return fmt.Sprintf("[sources.main]\ntype = \"etcd\"\nendpoints = [\"http://%s\"]\ndial_timeout = \"1s\"\n\n", proxy.Addr()) +
			fmt.Sprintf("[sources.web]\ntype = \"http\"\nurl = \"http://%s/doc.json\"\npoll_interval = \"50ms\"\n", web.upstream())
	}
	h.writeConfig(fmt.Sprintf(`[[mount]]
name = "bundle"
dir = %q
  [[mount.projections]]
  source = "main"
  prefix = "/p/"
  [[mount.projections]]
  source = "web"
  prefix = "flags/"
`, h.path("mnt", "bundle")))
	h.start()
	dir := h.path("mnt", "bundle")
	h.waitContent(dir, map[string]string{"app.conf": "listen 80", "dark-mode": "off"})

	proxy.Cut()
	h.waitLog("mount stale", "mount=bundle")
	web.put(t, "flags/dark-mode", "on")
	h.waitContent(dir, map[string]string{"app.conf": "listen 80", "dark-mode": "on"})

	h.put("/p/app.conf", "listen 8080")
	if err := proxy.Restore(); err != nil {
		t.Fatal(err)
	}
	h.waitContent(dir, map[string]string{"app.conf": "listen 8080", "dark-mode": "on"})
}
