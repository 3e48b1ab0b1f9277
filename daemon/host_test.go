package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// versionDirs returns the version directories in dir.
func versionDirs(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for _, name := range entries(t, dir) {
		if strings.HasPrefix(name, "..") && name != "..data" && name != "..data_tmp" {
			out = append(out, name)
		}
	}
	return out
}

// TestReplacedVersionsGoWhileHeldBack is issue 25's third finding: after a
// burst of writes, a mount whose next payload a guard rail holds back —
// allow_empty, min_keys — still loses its replaced versions once their
// grace (5 s) is over, and holds one version directory within grace + 1 s
// of the last switch.
func TestReplacedVersionsGoWhileHeldBack(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("empty", "/ae/", "optional = true") + h.mount("few", "/mk/", "min_keys = 2"))
	h.put("/ae/a", "0", "/mk/a", "0", "/mk/b", "0")
	h.start()
	h.waitContent(h.path("mnt", "empty"), map[string]string{"a": "0"})
	h.waitContent(h.path("mnt", "few"), map[string]string{"a": "0", "b": "0"})
	for i := 1; i <= 20; i++ {
		h.put("/ae/a", fmt.Sprint(i))
		h.put("/mk/a", fmt.Sprint(i))
		h.waitContent(h.path("mnt", "empty"), map[string]string{"a": fmt.Sprint(i)})
		h.waitContent(h.path("mnt", "few"), map[string]string{"a": fmt.Sprint(i), "b": "0"})
	}
	lastSwitch := time.Now()
	if n := len(versionDirs(t, h.path("mnt", "few"))); n < 2 {
		t.Fatalf("after the burst the mount holds %d version directories; the test wants replaced ones kept", n)
	}
	etcdDelete(t, h, "/ae/a")
	etcdDelete(t, h, "/mk/b")
	h.waitLog("update held back", "mount=empty")
	h.waitLog("update held back", "mount=few")
	for _, name := range []string{"empty", "few"} {
		dir := h.path("mnt", name)
		for deadline := lastSwitch.Add(6 * time.Second); ; {
			versions := versionDirs(t, dir)
			if len(versions) == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("mount %s still holds %d version directories %.1f s after its last switch (grace 5 s): %v", name, len(versions), time.Since(lastSwitch).Seconds(), versions)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// The held-back mounts keep their last content.
	h.waitContent(h.path("mnt", "empty"), map[string]string{"a": "20"})
	h.waitContent(h.path("mnt", "few"), map[string]string{"a": "20", "b": "0"})
}

// etcdDelete deletes key from the harness's etcd.
func etcdDelete(t *testing.T, h *harness, key string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if _, err := h.cli.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
}

// failedAttempt is one "operation failed" log line.
type failedAttempt struct {
	at      time.Time
	retryIn time.Duration
}

// failedAttempts returns the "operation failed" lines of mount in logs.
func failedAttempts(t *testing.T, logs, mount string) []failedAttempt {
	t.Helper()
	var out []failedAttempt
	for line := range strings.SplitSeq(logs, "\n") {
		if !strings.Contains(line, `msg="operation failed`) || !strings.Contains(line, "mount="+mount+" ") {
			continue
		}
		var a failedAttempt
		for field := range strings.FieldsSeq(line) {
			var err error
			switch k, v, _ := strings.Cut(field, "="); k {
			case "time":
				a.at, err = time.Parse(time.RFC3339Nano, v)
			case "retry_in":
				a.retryIn, err = time.ParseDuration(v)
			}
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
		}
		out = append(out, a)
	}
	return out
}

// TestHostFailureKeepsItsBackoff is issue 25's second finding: a mount
// refused because of the host (its directory replaced) is retried on the
// kubelet's backoff however many writes arrive — under 200 writes/s for
// 3 s it costs at most the backoff's attempts (0.5 s, 1 s, 2 s: four in
// all) — and each failure's retry_in is when the next attempt comes.
func TestHostFailureKeepsItsBackoff(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("m", "/m/"))
	h.put("/m/a", "0")
	h.start()
	dir := h.path("mnt", "m")
	h.waitContent(dir, map[string]string{"a": "0"})
	h.stop()
	if err := os.Rename(dir, dir+".away"); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	h.start()
	h.waitLog("operation failed", "mount=m", "reaches another directory")
	start := time.Now()
	for i := 0; time.Since(start) < 3*time.Second; i++ {
		h.put("/m/a", fmt.Sprint(i))
		time.Sleep(5 * time.Millisecond)
	}
	attempts := failedAttempts(t, h.logs.String(), "m")
	if len(attempts) > 4 {
		t.Errorf("%d attempts in 3 s of writes; the backoff allows 4", len(attempts))
	}
	for i := 1; i < len(attempts); i++ {
		if gap := attempts[i].at.Sub(attempts[i-1].at); gap < attempts[i-1].retryIn {
			t.Errorf("attempt %d came %v after the one before, which said retry_in=%v", i+1, gap, attempts[i-1].retryIn)
		}
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("kvmount wrote into the replacement: %v", entries)
	}
	if got, err := os.ReadFile(filepath.Join(dir+".away", "a")); err != nil || string(got) != "0" {
		t.Errorf("the mount moved away holds a = %q, %v; want 0", got, err)
	}
}

// watchFile adds an inotify watch on path, following a symlink there as
// fsnotify.Add(path) does (so a visible name's watch lands on the file in
// the version directory), and returns a channel that receives the time of
// the first event that says the file went away or changed
// (IN_DELETE_SELF, IN_ATTRIB — its link count dropped —, IN_IGNORED).
func watchFile(t *testing.T, path string) <-chan time.Time {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := unix.InotifyAddWatch(fd, path, unix.IN_DELETE_SELF|unix.IN_ATTRIB|unix.IN_MODIFY|unix.IN_MOVE_SELF); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	events := make(chan time.Time, 1)
	go func() {
		defer unix.Close(fd)
		buf := make([]byte, 4096)
		if n, err := unix.Read(fd, buf); err == nil && n > 0 {
			events <- time.Now()
		}
	}()
	t.Cleanup(func() { unix.Close(fd) })
	return events
}

// TestKeepReplaced is issue 25's fifth finding: a program that watches a
// visible file itself (inotify on the path, as fsnotify.Add(path) does)
// learns of a change when the replaced version is removed. With the
// default keep_replaced (5 s) that is not before the grace is over; with
// keep_replaced = "0s" — the kubelet's behaviour — it is right after the
// switch: the write that switched removes the replaced version. A mount's
// own setting overrides the global one.
func TestKeepReplaced(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("kept", "/kept/") + h.mount("kubelet", "/kubelet/", `keep_replaced = "0s"`))
	h.put("/kept/a", "0", "/kubelet/a", "0")
	h.start()
	for _, name := range []string{"kept", "kubelet"} {
		h.waitContent(h.path("mnt", name), map[string]string{"a": "0"})
	}
	kept := watchFile(t, h.path("mnt", "kept", "a"))
	kubelet := watchFile(t, h.path("mnt", "kubelet", "a"))
	put := time.Now()
	h.put("/kept/a", "1", "/kubelet/a", "1")
	h.waitContent(h.path("mnt", "kubelet"), map[string]string{"a": "1"})
	select {
	case at := <-kubelet:
		t.Logf("keep_replaced = 0s: the watcher of the file learned of the change %v after the put", at.Sub(put))
	case <-time.After(3 * time.Second):
		t.Fatal("keep_replaced = 0s: the watcher of the file heard nothing in 3 s")
	}
	// Removed by the write that replaced it, right after the switch: well
	// within a second, where the default grace keeps it 5 s.
	for deadline := time.Now().Add(time.Second); len(versionDirs(t, h.path("mnt", "kubelet"))) != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Errorf("keep_replaced = 0s: %d version directories a second after the change is visible; want 1", len(versionDirs(t, h.path("mnt", "kubelet"))))
			break
		}
	}
	h.waitContent(h.path("mnt", "kept"), map[string]string{"a": "1"})
	select {
	case at := <-kept:
		if d := at.Sub(put); d < 4*time.Second {
			t.Errorf("keep_replaced = 5s: the watcher heard of the change %v after the put, before the grace was over", d)
		}
	case <-time.After(3 * time.Second):
		// Not before the grace, as it should be; it comes after it.
		select {
		case at := <-kept:
			t.Logf("keep_replaced = 5s: the watcher of the file learned of the change %v after the put", at.Sub(put))
		case <-time.After(waitTimeout):
			t.Fatal("keep_replaced = 5s: the replaced version was never removed")
		}
	}
}

// TestManifestsStayOffTheMount: a disk mount's manifests live in
// state_dir/manifests/<mount>, one per version, and the mount holds the
// payload only; a tmpfs mount keeps none, so that the hashes of its files
// never reach the disk its files never touch.
func TestManifestsStayOffTheMount(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("conf", "/conf/") + h.mount("secret", "/secret/", `medium = "tmpfs"`))
	h.put("/conf/a", "1", "/secret/s", "2")
	h.start()
	version := h.waitContent(h.path("mnt", "conf"), map[string]string{"a": "1"})
	h.waitContent(h.path("mnt", "secret"), map[string]string{"s": "2"})
	if got := entries(t, h.path("mnt", "conf", version)); len(got) != 1 || got[0] != "a" {
		t.Errorf("the disk mount's version holds %v; want the payload only", got)
	}
	if got := entries(t, h.path("state", "manifests", "conf")); len(got) != 1 || got[0] != strings.TrimPrefix(version, "..") {
		t.Errorf("state_dir/manifests/conf holds %v; want the manifest of %s", got, version)
	}
	if got, err := os.ReadDir(h.path("state", "manifests", "secret")); err == nil && len(got) > 0 {
		t.Errorf("a tmpfs mount's manifest reached the disk: %v", got)
	}
}
