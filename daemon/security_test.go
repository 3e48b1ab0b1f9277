package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
)

// reachable makes the harness's directory reachable by an unprivileged
// user (t.TempDir's are 0700); it stays root's.
func (h *harness) reachable() {
	h.t.Helper()
	for _, d := range []string{filepath.Dir(h.base), h.base} {
		if err := os.Chmod(d, 0o755); err != nil {
			h.t.Fatal(err)
		}
	}
}

// victim makes a root-only directory with one file, standing for whatever
// an attacker would like kvmount to empty, chown or write into, and
// returns a check that it is as it was.
func victim(t *testing.T, dir string) func() {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "precious"), []byte("root's"), 0o600); err != nil {
		t.Fatal(err)
	}
	return func() {
		t.Helper()
		var st syscall.Stat_t
		if err := syscall.Stat(dir, &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 0 || st.Gid != 0 || st.Mode&0o7777 != 0o700 {
			t.Errorf("victim %s: owner %d:%d mode %o; want 0:0 700", dir, st.Uid, st.Gid, st.Mode&0o7777)
		}
		names := entries(t, dir)
		if len(names) != 1 || names[0] != "precious" {
			t.Errorf("victim %s holds %v; want only precious", dir, names)
		}
	}
}

// TestAncestorSwapAsUnprivilegedUser is the review's first finding, played
// by a real unprivileged user who owns a parent of the mount directory:
// swapping that parent for a symlink to a root-only directory, or for a
// directory of their own, never gets kvmount to empty, chown or write
// into what the path then reaches — at a resync or at a first start with
// the link already planted — and the refusal is reported. Put back, the
// mount carries on.
func TestAncestorSwapAsUnprivilegedUser(t *testing.T) {
	u := roottest.NewUser(t)   // owns a parent of the mount directory
	svc := roottest.NewUser(t) // the service the mount is for
	h := newHarness(t)
	h.reachable()
	socket := h.path("admin.sock")
	h.admin = "unix:" + socket
	app := h.path("srv", "app")
	if err := os.MkdirAll(app, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, app)
	dir := filepath.Join(app, "etc", "certs")
	planted := filepath.Join(app, "planted", "certs")
	intact := victim(t, h.path("victim"))
	u.Run(t, "ln -s "+h.path("victim")+" "+filepath.Join(app, "planted"))
	h.put("/certs/tls.key", "secret", "/planted/a", "1")
	mount := func(name, dir, prefix string) string {
		return "[[mount]]\nname = \"" + name + "\"\ndir = \"" + dir + "\"\nsource = \"main\"\nprefix = \"" + prefix + "\"\nuser = \"" + svc.Name + "\"\ndefault_mode = \"0400\"\n"
	}
	h.writeConfig(mount("certs", dir, "/certs/") + mount("planted", planted, "/planted/"))
	h.start()
	h.waitContent(dir, map[string]string{"tls.key": "secret"})
	// A first start with the link already planted: refused, reported.
	h.waitLog("operation failed", "mount=planted", "is a symlink")
	h.waitMetric(socket, `kvmount_mount_projected{mount="planted"} 0`)
	h.waitMetric(socket, `kvmount_guard_rejections_total{guard="mount_dir_replaced",mount="planted"}`)
	intact()

	// At a resync: the parent swapped for a symlink to the victim.
	u.Run(t, "cd "+app+" && mv etc etc.old && ln -s "+h.path("victim")+" etc")
	h.waitLog("operation failed", "mount=certs", "is a symlink")
	h.put("/certs/tls.key", "rotated")
	time.Sleep(1500 * time.Millisecond) // a resync and a retry
	intact()
	if got, _ := content(filepath.Join(app, "etc.old", "certs")); got["tls.key"] != "secret" {
		t.Errorf("the real mount directory holds %v", got)
	}

	// Swapped for a directory of the user's own: refused, not taken over.
	u.Run(t, "cd "+app+" && rm etc && mkdir -p etc/certs")
	h.waitLog("operation failed", "mount=certs", "reaches another directory than the one kvmount owns")
	h.waitMetric(socket, `kvmount_guard_rejections_total{guard="mount_dir_replaced",mount="certs"}`)
	time.Sleep(1500 * time.Millisecond)
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != uint32(u.UID) {
		t.Errorf("the user's directory was chowned to %d; want it left %d's", st.Uid, u.UID)
	}
	if names := entries(t, dir); len(names) != 0 {
		t.Errorf("kvmount wrote into the user's directory: %v", names)
	}
	if out, err := u.Command("sh", "-c", "cat "+filepath.Join(app, "etc.old", "certs", "tls.key")).CombinedOutput(); err == nil || strings.Contains(string(out), "secret") {
		t.Errorf("the user read the key: %q", out)
	}

	// Put back: the mount follows its source again.
	u.Run(t, "cd "+app+" && rm -r etc && mv etc.old etc")
	h.waitContent(dir, map[string]string{"tls.key": "rotated"})
	intact()
}

// waitMetric waits until /metrics on the admin socket has a line
// containing want.
func (h *harness) waitMetric(socket, want string) {
	h.t.Helper()
	h.waitAdmin(socket, "/metrics", want)
}

// TestMovedMountDirIsReportedFailed is issue 36's fourteenth finding: the
// owner of the mount directory's parent renames it away and puts a
// symlink in its place. With no resync due for an hour, the next change
// finds it at the switch: the mount is reported failed — the path no
// longer reaches kvmount's directory —, nothing is written into the
// directory renamed away nor through the symlink; put back, the mount
// carries on.
func TestMovedMountDirIsReportedFailed(t *testing.T) {
	u := roottest.NewUser(t)
	h := newHarness(t)
	h.reachable()
	h.resync = "1h"
	app := h.path("srv", "app")
	if err := os.MkdirAll(app, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, app)
	dir := filepath.Join(app, "conf")
	intact := victim(t, h.path("victim"))
	h.put("/conf/app.conf", "v1")
	h.writeConfig("[[mount]]\nname = \"conf\"\ndir = \"" + dir + "\"\nsource = \"main\"\nprefix = \"/conf/\"\n")
	h.start()
	h.waitContent(dir, map[string]string{"app.conf": "v1"})

	u.Run(t, "cd "+app+" && mv conf conf.old && ln -s "+h.path("victim")+" conf")
	h.put("/conf/app.conf", "v2")
	h.waitLog("operation failed", "mount=conf", "the path reaches another directory than the one kvmount owns")
	h.waitAdmin(h.statusSocket(), "/status", `"state": "failed"`)
	if got, _ := content(filepath.Join(app, "conf.old")); got["app.conf"] != "v1" {
		t.Errorf("the directory renamed away holds %v; want v1 untouched", got)
	}
	intact()

	u.Run(t, "cd "+app+" && rm conf && mv conf.old conf")
	h.waitContent(dir, map[string]string{"app.conf": "v2"})
}
