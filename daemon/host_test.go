package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
