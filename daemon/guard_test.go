package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/projector"
)

func TestTmpfsMedium(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	dir := h.path("mnt", "secrets")
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
	if size, want := int64(sfs.Blocks)*sfs.Bsize, projector.TmpfsSize(64<<10); size != want {
		t.Errorf("tmpfs size %d; want %d (room for three versions of 64 KiB)", size, want)
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
	// The worker does not send it: the monitor would refuse it as it
	// arrives, and stop the worker (a payload past the mount's bounds is
	// a breach of the protocol).
	h.waitLog("cannot send mount payload; keeping last content", "mount=secrets", "more than size_limit")
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

// TestImmutable: an immutable mount stops following its source once
// projected; a reload and a restart read it again.
func TestImmutable(t *testing.T) {
	h := newHarness(t)
	h.put("/im/a", "1")
	// "follower" follows the same prefix: once it holds a write, the
	// immutable mount would hold it too if it still followed.
	cfg := h.mount("im", "/im/", "immutable = true") + h.mount("follower", "/im/")
	h.writeConfig(cfg)
	h.start()
	dir, follower := h.path("mnt", "im"), h.path("mnt", "follower")
	h.waitContent(dir, map[string]string{"a": "1"})
	h.waitLog("immutable mount has its payload; no longer following its sources", "mount=im")
	h.put("/im/a", "2")
	h.waitContent(follower, map[string]string{"a": "2"})
	h.waitReady()
	if got, _ := content(dir); got["a"] != "1" {
		t.Errorf("immutable mount changed: %v", got)
	}
	// A reload reads it again (README: "read again on reload or restart").
	h.sighup()
	h.waitContent(dir, map[string]string{"a": "2"})
	h.put("/im/a", "3")
	h.waitContent(follower, map[string]string{"a": "3"})
	h.waitReady()
	if got, _ := content(dir); got["a"] != "2" {
		t.Errorf("immutable mount changed after its reload: %v", got)
	}
	// A restart reads it again.
	h.stop()
	h.start()
	h.waitContent(dir, map[string]string{"a": "3"})
}

// TestCheckCommand: a version the check refuses keeps the last content;
// the check reads the new version through the mount's own path (the
// namespace view) as well as through {{dir}} and KVMOUNT_DIR (never its
// working directory, which is "/"); the last lines of its output
// are in the error on disk, and not where show_check_output is off, where
// they are at debug level only (a check may echo secret values).
func TestCheckCommand(t *testing.T) {
	h := newHarness(t)
	h.put("/cc/app.conf", "valid 1", "/hc/app.conf", "valid 1")
	dir, hidden := h.path("mnt", "cc"), h.path("mnt", "hc")
	check := func(d string) string {
		return `check_command = ["sh", "-c", "grep -q valid ` + d + `/app.conf && grep -q valid {{dir}}/app.conf && grep -q valid $KVMOUNT_DIR/app.conf || { echo 'app.conf: no valid line' >&2; exit 3; }"]`
	}
	h.writeConfig(h.mount("cc", "/cc/", check(dir), `check_timeout = "5s"`) + h.mount("hc", "/hc/", check(hidden), `show_check_output = false`))
	h.start()
	h.waitContent(dir, map[string]string{"app.conf": "valid 1"})
	h.waitContent(hidden, map[string]string{"app.conf": "valid 1"})
	h.put("/cc/app.conf", "broken", "/hc/app.conf", "broken")
	h.waitLog("level=ERROR", "operation failed", "mount=cc", "check_command sh: exit status 3: app.conf: no valid line")
	h.waitLog("level=ERROR", "operation failed", "mount=hc", "check_command sh: exit status 3 (its output is not shown for this mount")
	h.waitLog("level=DEBUG", "check_command finished", "mount=hc", "app.conf: no valid line")
	if n := h.logs.Count("level=ERROR", "mount=hc", "app.conf: no valid line"); n != 0 {
		t.Errorf("the output of a check with show_check_output = false was logged at error level %d times", n)
	}
	for _, d := range []string{dir, hidden} {
		if got, _ := content(d); got["app.conf"] != "valid 1" {
			t.Errorf("a refused version reached %s: %v", d, got)
		}
	}
	h.put("/cc/app.conf", "valid 2", "/hc/app.conf", "valid 2")
	h.waitContent(dir, map[string]string{"app.conf": "valid 2"})
	h.waitContent(hidden, map[string]string{"app.conf": "valid 2"})
}

// TestCheckUser runs check_command as check_user.
func TestCheckUser(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	// check_user must reach the version directory: t.TempDir makes 0700
	// directories.
	for d := h.path(); d != filepath.Dir(d) && strings.HasPrefix(d, os.TempDir()+"/"); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	h.put("/cu/a", "1", "/cw/a", "1")
	h.writeConfig(h.mount("cu", "/cu/", `check_command = ["sh", "-c", "test $(id -u):$(id -g) = 4321:4321"]`, `check_user = "4321"`) +
		h.mount("cw", "/cw/", `check_command = ["sh", "-c", "test $(id -u) = 0"]`, `check_user = "4321"`))
	h.start()
	h.waitContent(h.path("mnt", "cu"), map[string]string{"a": "1"})
	h.waitLog("operation failed", "mount=cw", "check_command sh: exit status 1")
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

// TestSizeLimits: a value over max_value_size or a payload over
// max_mount_size keeps the mount's content, is logged, and is counted as a
// guard rejection in /metrics.
func TestSizeLimits(t *testing.T) {
	h := newHarness(t)
	socket := h.path("admin.sock")
	h.admin = "unix:" + socket
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
	// The pass that logged the error reports the mount's state right after.
	for _, want := range []string{`kvmount_guard_rejections_total{guard="max_value_size",mount="sz"} 1`, `kvmount_guard_rejections_total{guard="max_mount_size",mount="ms"} 1`, `kvmount_mount_projected{mount="sz"} 0`} {
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
			_, metrics := unixGet(t, socket, "/metrics")
			if strings.Contains(metrics, want) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("/metrics lacks %s:\n%s", want, metrics)
			}
		}
	}
	h.put("/sz/a", "fits", "/ms/c", etcdtest.Delete)
	h.waitContent(h.path("mnt", "sz"), map[string]string{"a": "fits"})
}

// TestMaxTotalSize: a payload that would take every mount's payloads
// together past max_total_size is held back by the worker — logged, its
// mount keeping its content, counted as a guard rejection — and goes
// through once it fits beside the others.
func TestMaxTotalSize(t *testing.T) {
	h := newHarness(t)
	socket := h.path("admin.sock")
	h.admin = "unix:" + socket
	h.settings = `max_total_size = "30B"`
	h.put("/ta/a", "1234567890", "/tb/b", "1234567890")
	h.writeConfig(h.mount("ta", "/ta/") + h.mount("tb", "/tb/"))
	h.start()
	h.waitContent(h.path("mnt", "ta"), map[string]string{"a": "1234567890"})
	h.waitContent(h.path("mnt", "tb"), map[string]string{"b": "1234567890"})
	h.put("/tb/c", "1234567890X") // 31 bytes together
	h.waitLog("cannot send mount payload; keeping last content", "mount=tb", "past max_total_size (30 bytes)")
	h.waitMetric(socket, `kvmount_guard_rejections_total{guard="max_total_size",mount="tb"}`)
	if got, _ := content(h.path("mnt", "tb")); len(got) != 1 {
		t.Errorf("a payload past max_total_size replaced the content: %v", got)
	}
	// tb's own payload is replaced, not added: 20 bytes of it fit.
	h.put("/tb/c", "123456789")
	h.waitContent(h.path("mnt", "tb"), map[string]string{"b": "1234567890", "c": "123456789"})
	h.put("/ta/a", "1234567890AB") // 31 again, now through ta
	h.waitLog("cannot send mount payload; keeping last content", "mount=ta", "past max_total_size (30 bytes)")
	h.put("/ta/a", "1")
	h.waitContent(h.path("mnt", "ta"), map[string]string{"a": "1"})
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
			fmt.Sprintf("[sources.web]\ntype = \"http\"\nurl = \"http://%s/doc.json\"\npoll_interval = \"100ms\"\n", web.upstream())
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

// TestForeignTmpfsIsRefused: a tmpfs that kvmount did not mount at a
// mount's dir is refused before any mount call; its size, options and files
// stay.
func TestForeignTmpfsIsRefused(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	dir := h.path("mnt", "f")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m,mode=0711"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "theirs"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.put("/f/a", "1")
	h.writeConfig(h.mount("f", "/f/", `medium = "tmpfs"`))
	h.start()
	h.waitLog("operation failed", "mount=f", "did not mount")
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	info, _ := os.Stat(dir)
	if size := int64(sfs.Blocks) * sfs.Bsize; size != 1<<20 || info.Mode().Perm() != 0o711 || roottest.MountsAt(t, dir) != 1 {
		t.Errorf("foreign tmpfs changed: size %d, mode %v, %d mounts", size, info.Mode().Perm(), roottest.MountsAt(t, dir))
	}
	if got := entries(t, dir); len(got) != 1 || got[0] != "theirs" {
		t.Errorf("foreign tmpfs holds %v; want [theirs]", got)
	}
}

// TestTmpfsReplacesAFullPayload: a payload of size_limit replaces another
// of size_limit whose files all changed, again and again, on a tmpfs sized
// by kvmount; one page more than size_limit is refused before writing —
// by the worker, which does not send it.
func TestTmpfsReplacesAFullPayload(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	dir := h.path("mnt", "full")
	page := os.Getpagesize()
	const files = 8
	values := func(round int) ([]string, map[string]string) {
		var kv []string
		want := map[string]string{}
		for i := range files {
			v := strings.Repeat(strconv.Itoa(round%10), page)
			kv = append(kv, fmt.Sprintf("/full/f%d", i), v)
			want[fmt.Sprintf("f%d", i)] = v
		}
		return kv, want
	}
	kv, want := values(0)
	h.put(kv...)
	h.writeConfig(h.mount("full", "/full/", `medium = "tmpfs"`, fmt.Sprintf("size_limit = \"%dKiB\"", files*page/1024)))
	h.start()
	h.waitContent(dir, want)
	for round := 1; round <= 5; round++ {
		kv, want := values(round)
		h.put(kv...)
		h.waitContent(dir, want)
	}
	h.put("/full/one-more", "x")
	h.waitLog("cannot send mount payload; keeping last content", "mount=full", "more than size_limit")
	if n := h.logs.Count("no space left"); n != 0 {
		t.Errorf("%d writes ran out of space", n)
	}
}

// TestDirModeAndOwnerFollowReload: a reload that tightens dir_mode and
// changes the owner applies them to the mount directory, the version
// directory and the directories inside it, on disk and on tmpfs.
func TestDirModeAndOwnerFollowReload(t *testing.T) {
	roottest.Require(t)
	for _, medium := range []string{"disk", "tmpfs"} {
		t.Run(medium, func(t *testing.T) {
			h := newHarness(t)
			dir := h.path("mnt", "m")
			h.put("/m/a", "1", "/m/sub/deep/b", "2")
			cfg := func(mode, user string) string {
				return h.mount("m", "/m/", fmt.Sprintf("medium = %q", medium), fmt.Sprintf("dir_mode = %q", mode), fmt.Sprintf("user = %q", user), fmt.Sprintf("group = %q", user))
			}
			h.writeConfig(cfg("0775", "1234"))
			h.start()
			want := map[string]string{"a": "1", "sub/deep/b": "2"}
			h.waitContent(dir, want)
			check := func(mode os.FileMode, id uint32) {
				t.Helper()
				version, _ := os.Readlink(filepath.Join(dir, "..data"))
				for _, d := range []string{"", version, version + "/sub", version + "/sub/deep"} {
					info, err := os.Lstat(filepath.Join(dir, d))
					if err != nil {
						t.Fatal(err)
					}
					st := info.Sys().(*syscall.Stat_t)
					if info.Mode().Perm() != mode || st.Uid != id || st.Gid != id {
						t.Errorf("%s: mode %v owner %d:%d; want %v %d:%d", filepath.Join("mnt/m", d), info.Mode().Perm(), st.Uid, st.Gid, mode, id, id)
					}
				}
			}
			check(0o775, 1234)
			h.writeConfig(cfg("0750", "4321"))
			h.sighup()
			deadline := time.Now().Add(waitTimeout)
			for {
				info, _ := os.Stat(filepath.Join(dir, "..data", "sub"))
				if info != nil && info.Mode().Perm() == 0o750 && info.Sys().(*syscall.Stat_t).Uid == 4321 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("dir_mode and owner never applied after reload")
				}
				time.Sleep(5 * time.Millisecond)
			}
			h.waitContent(dir, want)
			check(0o750, 4321)
		})
	}
}

// TestFileCountLimits is the review's fourteenth finding: many empty keys
// took inodes and kernel memory that no byte count saw (100,000 put 200,003
// inodes and 205 MB into a 64 KiB tmpfs). Every file and directory now
// counts a page against size_limit, max_files bounds every medium, and the
// tmpfs has an inode limit to match; a payload over them is held back —
// the mount keeps its content — and counted as a guard rejection.
func TestFileCountLimits(t *testing.T) {
	roottest.Require(t)
	h := newHarness(t)
	socket := h.path("admin.sock")
	h.admin = "unix:" + socket
	dir, disk := h.path("mnt", "small"), h.path("mnt", "few")
	h.put("/small/a", "1", "/few/a", "1")
	h.writeConfig(h.mount("small", "/small/", `medium = "tmpfs"`, `size_limit = "64KiB"`) + h.mount("few", "/few/", `max_files = 50`))
	h.start()
	h.waitContent(dir, map[string]string{"a": "1"})
	h.waitContent(disk, map[string]string{"a": "1"})
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	if want := uint64(projector.TmpfsInodes(64<<10, 10_000)); sfs.Files != want {
		t.Errorf("the tmpfs has %d inodes; want %d", sfs.Files, want)
	}
	// 100 empty keys: 0 bytes, but 100 pages against a 16-page size_limit.
	var kv []string
	for i := range 100 {
		kv = append(kv, fmt.Sprintf("/small/e%03d", i), "")
		if i < 60 {
			kv = append(kv, fmt.Sprintf("/few/e%03d", i), "")
		}
	}
	for len(kv) > 0 { // etcd takes at most 128 operations per transaction
		n := min(len(kv), 200)
		h.put(kv[:n]...)
		kv = kv[n:]
	}
	h.waitLog("cannot send mount payload; keeping last content", "mount=small", "more than size_limit")
	h.waitLog("cannot build mount payload", "mount=few", "max_files (50)")
	h.waitMetric(socket, `kvmount_guard_rejections_total{guard="size_limit",mount="small"}`)
	h.waitMetric(socket, `kvmount_guard_rejections_total{guard="max_files",mount="few"}`)
	for _, d := range []string{dir, disk} {
		if got, _ := content(d); len(got) != 1 || got["a"] != "1" {
			t.Errorf("%s holds %s after the refused payload; want its last content", d, summary(got))
		}
	}
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	if used := sfs.Files - sfs.Ffree; used > 16 {
		t.Errorf("%d inodes in use on the tmpfs; want the one version's few", used)
	}
}
