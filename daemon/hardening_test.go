package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/admin"
)

// TestEtcdLostItsData: etcd at revision ~50 is stopped, its data directory
// removed and started again empty on the same ports. The watch would resume
// at revision 51 and wait silently; kvmount must notice the revision going
// back and follow the new store.
func TestEtcdLostItsData(t *testing.T) {
	h := newHarness(t)
	for i := range 50 {
		h.put("/w/a", strconv.Itoa(i))
	}
	h.writeConfig(h.mount("w", "/w/", "allow_empty = true"))
	h.start()
	dir := h.path("mnt", "w")
	h.waitContent(dir, map[string]string{"a": "49"})
	h.etcd.Stop()
	if err := h.etcd.Wipe(); err != nil {
		t.Fatal(err)
	}
	if err := h.etcd.Restart(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	h.put("/w/b", "after")
	h.waitContentWithin(dir, map[string]string{"b": "after"}, 10*time.Second)
	t.Logf("the write after the wipe reached the mount in %v", time.Since(start))
	h.waitLog("re-reading", "revision went back")
}

// waitContentWithin is waitContent with a shorter bound.
func (h *harness) waitContentWithin(dir string, want map[string]string, d time.Duration) {
	h.t.Helper()
	deadline := time.Now().Add(d)
	for {
		got, _ := content(dir)
		if fmt.Sprint(got) == fmt.Sprint(want) {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("mount %s holds %s after %v; want %s", dir, summary(got), d, summary(want))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestOneInstancePerStateDir: a second run or once on the same state
// directory exits at once with an error naming the lock file and the PID
// that holds it; the first keeps running.
func TestOneInstancePerStateDir(t *testing.T) {
	h := newHarness(t)
	h.put("/l/a", "1")
	h.writeConfig(h.mount("l", "/l/"))
	h.start()
	h.waitContent(h.path("mnt", "l"), map[string]string{"a": "1"})
	lock := filepath.Join(h.path("state"), "kvmount.lock")
	for name, run := range map[string]func(ctx context.Context) error{
		"run":  func(ctx context.Context) error { return Run(ctx, h.options()) },
		"once": func(ctx context.Context) error { return Once(ctx, h.options(), 5*time.Second) },
	} {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		start := time.Now()
		err := run(ctx)
		cancel()
		if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), lock) || !strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
			t.Errorf("second %s = %v; want ErrLocked naming %s and pid %d", name, err, lock, os.Getpid())
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("second %s took %v to give up; want at once", name, d)
		}
	}
	h.put("/l/a", "2")
	h.waitContent(h.path("mnt", "l"), map[string]string{"a": "2"})
	h.stop()
	// Released at the end: a new instance starts.
	h.start()
	h.waitReady()
}

// TestStrayFileNeverStopsUpdates: a file added by hand to a mount kvmount
// owns is drift — the resync removes it and logs its name — and later
// updates keep arriving.
func TestStrayFileNeverStopsUpdates(t *testing.T) {
	h := newHarness(t)
	h.put("/s/a", "1")
	h.writeConfig(h.mount("s", "/s/"))
	h.start()
	dir := h.path("mnt", "s")
	h.waitContent(dir, map[string]string{"a": "1"})
	if err := os.WriteFile(filepath.Join(dir, "stray.txt"), []byte("by hand"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.waitLog("removed an entry kvmount did not write", "mount=s", "entry=stray.txt")
	h.waitGone(filepath.Join(dir, "stray.txt"))
	for i := 2; i <= 4; i++ {
		h.put("/s/a", strconv.Itoa(i))
		h.waitContent(dir, map[string]string{"a": strconv.Itoa(i)})
	}
	if n := h.logs.Count("operation failed", "mount=s"); n != 0 {
		t.Errorf("%d failed operations after a stray file; want none", n)
	}
}

// kubeletLayout makes dir look like a mount of someone else's: a version
// directory, ..data and a visible symlink.
func kubeletLayout(t *testing.T, dir string) {
	t.Helper()
	version := "..2020_01_01_00_00_00.000000001"
	if err := os.MkdirAll(filepath.Join(dir, version), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, version, "theirs.conf"), []byte("theirs"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(version, filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..data/theirs.conf", filepath.Join(dir, "theirs.conf")); err != nil {
		t.Fatal(err)
	}
}

// TestTeardownThroughASymlinkTouchesNothing: a mount removed from the
// configuration whose directory was replaced by a symlink to a directory
// holding a kubelet-style layout: nothing behind the symlink is touched,
// and the mount is forgotten with a warning (nothing kvmount wrote is
// reachable there).
func TestTeardownThroughASymlinkTouchesNothing(t *testing.T) {
	h := newHarness(t)
	h.put("/t/a", "1")
	h.writeConfig(h.mount("t", "/t/"))
	h.start()
	dir := h.path("mnt", "t")
	h.waitContent(dir, map[string]string{"a": "1"})
	h.waitReady()
	h.stop()

	victim := h.path("victim")
	kubeletLayout(t, victim)
	before := tree(t, victim)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, dir); err != nil {
		t.Fatal(err)
	}
	h.writeConfig("")
	h.start()
	h.waitLog("mount directory replaced by someone else: left untouched, and the mount forgotten", "mount=t", "symlink")
	if after := tree(t, victim); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("the directory behind the symlink changed:\nbefore %v\nafter  %v", before, after)
	}
	if target, err := os.Readlink(dir); err != nil || target != victim {
		t.Errorf("the symlink itself changed: %q, %v", target, err)
	}
}

// TestSymlinkedMountDirIsRefusedAtSetup: a configured dir that is a symlink
// is refused at setup; nothing is written behind it.
func TestSymlinkedMountDirIsRefusedAtSetup(t *testing.T) {
	h := newHarness(t)
	victim := h.path("victim")
	if err := os.MkdirAll(victim, 0o700); err != nil {
		t.Fatal(err)
	}
	dir := h.path("mnt", "l")
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, dir); err != nil {
		t.Fatal(err)
	}
	h.put("/l/a", "1")
	h.writeConfig(h.mount("l", "/l/"))
	h.start()
	h.waitLog("operation failed", "mount=l", "symlink")
	if got := entries(t, victim); len(got) != 0 {
		t.Errorf("written behind the symlink: %v", got)
	}
	if info, _ := os.Stat(victim); info.Mode().Perm() != 0o700 {
		t.Errorf("mode behind the symlink changed to %v", info.Mode().Perm())
	}
}

// waitNotified waits for the daemon to tell systemd state.
func (h *harness) waitNotified(state string) {
	h.t.Helper()
	deadline := time.After(waitTimeout)
	for {
		select {
		case s := <-h.notified:
			if s == state {
				return
			}
		case <-deadline:
			h.t.Fatalf("the daemon never reported %q", state)
		}
	}
}

// TestLogLevelOnReload: a reload applies a new log_level at once.
func TestLogLevelOnReload(t *testing.T) {
	h := newHarness(t)
	socket := h.path("admin.sock")
	h.admin = "unix:" + socket
	h.put("/ll/a", "1")
	h.writeConfig(h.mount("ll", "/ll/"))
	h.start()
	dir := h.path("mnt", "ll")
	h.waitContent(dir, map[string]string{"a": "1"})
	h.waitReady()
	data, err := os.ReadFile(h.config)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(h.config, []byte(strings.Replace(string(data), `log_level = "debug"`, `log_level = "error"`, 1)), 0o644); err != nil {
		t.Fatal(err)
	}
	h.sighup()
	h.waitNotified("reloading")
	h.waitNotified("ready")
	h.put("/ll/a", "2") // revision 3, projected at log_level error
	h.waitContent(dir, map[string]string{"a": "2"})
	// The files switch before the loop logs the projection: wait until
	// the loop has handled it (the admin endpoint observes the same
	// event right after the log line) before going back to debug.
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		_, body := unixGet(t, h.statusSocket(), "/status")
		var st admin.Status
		if err := json.Unmarshal([]byte(body), &st); err == nil && st.Mounts["ll"] != nil && st.Mounts["ll"].Revision == "main@3" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/status never showed revision main@3: %s", body)
		}
	}
	h.writeConfig(h.mount("ll", "/ll/")) // back to debug
	h.sighup()
	h.waitNotified("reloading")
	h.waitNotified("ready")
	h.put("/ll/a", "3") // revision 4
	h.waitContent(dir, map[string]string{"a": "3"})
	h.waitLog("msg=projected", "revision=main@4")
	if n := h.logs.Count("msg=projected", "revision=main@3"); n != 0 {
		t.Errorf("revision 3 was logged at info level %d times under log_level error", n)
	}
}

// TestResyncIntervalOnReload: drift is not repaired under a resync of an
// hour; a reload to one second repairs it. A state_dir opened wider than
// 0700 is tightened.
func TestResyncIntervalOnReload(t *testing.T) {
	h := newHarness(t)
	h.put("/ri/a", "1")
	h.writeConfig(h.mount("ri", "/ri/"))
	hourly := func() {
		data, err := os.ReadFile(h.config)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(h.config, []byte(strings.Replace(string(data), `resync_interval = "1s"`, `resync_interval = "1h"`, 1)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	hourly()
	if err := os.MkdirAll(h.path("state"), 0o755); err != nil {
		t.Fatal(err)
	}
	h.start()
	dir := h.path("mnt", "ri")
	h.waitContent(dir, map[string]string{"a": "1"})
	if info, err := os.Stat(h.path("state")); err != nil || info.Mode().Perm() != 0o700 {
		t.Errorf("state_dir mode %v, %v; want 0700", info.Mode().Perm(), err)
	}
	h.waitReady()
	if err := os.Remove(filepath.Join(dir, "a")); err != nil {
		t.Fatal(err)
	}
	h.writeConfig(h.mount("ri", "/ri/")) // resync_interval = "1s"
	h.sighup()
	h.waitContent(dir, map[string]string{"a": "1"})
	h.waitLog("repaired drift", "mount=ri")
}
