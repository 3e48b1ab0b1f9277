package daemon

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvmount/kvmount/projector"
)

// record makes a value for revision n that shows whether it was read
// whole: its length varies with n and it ends with its own checksum.
func record(n int) string {
	body := fmt.Sprintf("rev=%d;", n) + strings.Repeat("x", (n*37)%2000)
	sum := sha256.Sum256([]byte(body))
	return body + ";" + hex.EncodeToString(sum[:4])
}

// recordRev returns the revision of a whole record, or -1 for a partial or
// corrupt one.
func recordRev(data string) int {
	i := strings.LastIndexByte(data, ';')
	if i < 0 {
		return -1
	}
	sum := sha256.Sum256([]byte(data[:i]))
	if hex.EncodeToString(sum[:4]) != data[i+1:] {
		return -1
	}
	var n int
	if _, err := fmt.Sscanf(data, "rev=%d;", &n); err != nil {
		return -1
	}
	return n
}

// TestReaderConsistency streams multi-key transactions while readers read:
// readers that resolve ..data once never see files of two revisions, and
// readers of the visible names never see a missing or partial file.
func TestReaderConsistency(t *testing.T) {
	h := newHarness(t)
	keys := []string{"a.conf", "b.conf", "nested/c.conf"}
	txn := func(n int) {
		var kv []string
		for _, k := range keys {
			kv = append(kv, "/rc/"+k, record(n))
		}
		h.put(kv...)
	}
	txn(0)
	h.writeConfig(h.mount("rc", "/rc/"))
	h.start()
	dir := h.path("mnt", "rc")
	want := map[string]string{}
	for _, k := range keys {
		want[k] = record(0)
	}
	h.waitContent(dir, want)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var visibleReads atomic.Int64
	reader := func(read func() bool) {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if read() {
				return
			}
		}
	}
	// Resolve ..data once, read every file below it.
	stopVersions := readVersions(t, dir, keys, func(version string, values []string) {
		revs := map[int]bool{}
		for _, v := range values {
			revs[recordRev(v)] = true
		}
		if len(revs) != 1 || revs[-1] {
			t.Errorf("version %s holds revisions %v", version, revs)
		}
	})
	// Open the visible names, as a service does.
	for _, k := range keys {
		wg.Add(1)
		go reader(func() bool {
			data, err := os.ReadFile(filepath.Join(dir, k))
			if err != nil {
				t.Errorf("visible %s: %v", k, err)
				return true
			}
			if recordRev(string(data)) < 0 {
				t.Errorf("visible %s: partial or corrupt content (%d bytes)", k, len(data))
				return true
			}
			visibleReads.Add(1)
			return false
		})
	}
	const rounds = 500
	for n := 1; n <= rounds; n++ {
		txn(n)
	}
	for _, k := range keys {
		want[k] = record(rounds)
	}
	h.waitContent(dir, want)
	close(stop)
	wg.Wait()
	snapshotReads := stopVersions()
	t.Logf("%d whole-version reads, %d visible-name reads during %d transactions", snapshotReads, visibleReads.Load(), rounds)
	if snapshotReads < 100 || visibleReads.Load() < 100 {
		t.Errorf("too few reads to mean anything")
	}
}

// tree records every path below root with its type, mode and content, to
// prove that nothing outside a mount changed.
func tree(t *testing.T, root string, skip ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		for _, s := range skip {
			if p == s {
				return filepath.SkipDir
			}
		}
		info, err := os.Lstat(p)
		if err != nil {
			return err
		}
		desc := info.Mode().String()
		switch {
		case info.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			desc += " -> " + target
		case info.Mode().IsRegular():
			data, _ := os.ReadFile(p)
			sum := sha256.Sum256(data)
			desc += " " + hex.EncodeToString(sum[:8])
		}
		out[p] = desc
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestHostileInputChangesNothingOutside feeds keys that try to leave the
// mount and plants symlinks inside it: nothing outside the mount directory
// is created, changed or removed, and planted symlinks are never followed.
func TestHostileInputChangesNothingOutside(t *testing.T) {
	h := newHarness(t)
	outside := h.path("outside")
	if err := os.MkdirAll(filepath.Join(outside, "dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	precious := filepath.Join(outside, "precious.conf")
	if err := os.WriteFile(precious, []byte("do not touch"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := h.path("mnt", "h")
	mounts := h.path("mnt")
	state := h.path("state")
	// The keys: escapes by every route the path rules know.
	h.put("/h/app.conf", "v1",
		"/h/../outside/precious.conf", "x",
		"/h/../../outside/new", "x",
		"/h/a/../../outside/dir/x", "x",
		"/h/..data", "x",
		"/h/..data_tmp", "x",
		"/h/..2026_01_01_00_00_00.1/x", "x",
		"/h/nul\x00/x", "x",
		"/h/"+strings.Repeat("n", 256), "x",
	)
	h.writeConfig(h.mount("h", "/h/"))
	before := tree(t, h.base, dir, state, h.path("etcd"))
	h.start()
	h.waitContent(dir, map[string]string{"app.conf": "v1"})

	// Plant a symlink to the precious file where the writer's file is.
	version, err := os.Readlink(filepath.Join(dir, projector.DataDirName))
	if err != nil {
		t.Fatal(err)
	}
	inVersion := filepath.Join(dir, version, "app.conf")
	if err := os.Remove(inVersion); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(precious, inVersion); err != nil {
		t.Fatal(err)
	}
	h.put("/h/app.conf", "v2")
	h.waitContent(dir, map[string]string{"app.conf": "v2"})
	// Plant one where a new visible name will go.
	if err := os.Symlink(filepath.Join(outside, "dir"), filepath.Join(dir, "new.conf")); err != nil {
		t.Fatal(err)
	}
	h.put("/h/new.conf", "n")
	h.waitLog("operation failed", "mount=h", "new.conf is in the way")
	if got, _ := content(dir); got["app.conf"] != "v2" {
		t.Errorf("mount lost its content: %v", got)
	}
	h.stop()

	// Only the mount directory itself is skipped: its parent, where
	// "../x" would land, is compared like everything else.
	after := tree(t, h.base, dir, state, h.path("etcd"))
	for p := range after {
		if _, ok := before[p]; !ok && p != mounts && p != dir && p != filepath.Dir(h.statusSocket()) {
			t.Errorf("created outside the mount: %s", p)
		}
	}
	for p, desc := range before {
		if after[p] != desc {
			t.Errorf("changed outside the mount: %s: %q -> %q", p, desc, after[p])
		}
	}
	if data, err := os.ReadFile(precious); err != nil || string(data) != "do not touch" {
		t.Errorf("precious file = %q, %v", data, err)
	}
	if entries, _ := os.ReadDir(filepath.Join(outside, "dir")); len(entries) != 0 {
		t.Errorf("a planted symlink was followed: %s holds %d entries", filepath.Join(outside, "dir"), len(entries))
	}
}

// TestNewNamesAreVisibleAtTheSwitch: every transaction adds a new
// top-level name; a reader that resolves ..data and then opens each name of
// that version through its visible path must always find it — the visible
// symlink exists before the switch, not after (the kubelet's order).
func TestNewNamesAreVisibleAtTheSwitch(t *testing.T) {
	h := newHarness(t)
	h.put("/nn/n0000", "0")
	h.writeConfig(h.mount("nn", "/nn/"))
	h.start()
	dir := h.path("mnt", "nn")
	h.waitContent(dir, map[string]string{"n0000": "0"})
	stop := make(chan struct{})
	var rounds, failures atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			version, err := os.Readlink(filepath.Join(dir, projector.DataDirName))
			if err != nil {
				t.Errorf("readlink ..data: %v", err)
				return
			}
			names, err := os.ReadDir(filepath.Join(dir, version))
			if err != nil {
				continue // replaced and removed meanwhile
			}
			for _, e := range names {
				if _, err := os.ReadFile(filepath.Join(dir, e.Name())); err != nil {
					if failures.Add(1) <= 3 {
						t.Errorf("version %s holds %s, but its visible name fails: %v", version, e.Name(), err)
					}
				}
			}
			rounds.Add(1)
		}
	}()
	const n = 200
	want := map[string]string{"n0000": "0"}
	for i := 1; i <= n; i++ {
		h.put(fmt.Sprintf("/nn/n%04d", i), strconv.Itoa(i))
		want[fmt.Sprintf("n%04d", i)] = strconv.Itoa(i)
	}
	h.waitContent(dir, want)
	close(stop)
	wg.Wait()
	t.Logf("%d reader rounds over %d transactions, %d failed", rounds.Load(), n, failures.Load())
	if rounds.Load() < n {
		t.Errorf("only %d reader rounds", rounds.Load())
	}
}
