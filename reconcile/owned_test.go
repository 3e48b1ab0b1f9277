package reconcile

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

func TestOwnedRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	o, err := LoadOwned(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(o.All()) != 0 {
		t.Fatalf("new record holds %v", o.All())
	}
	if info, err := os.Stat(dir); err != nil || info.Mode().Perm() != 0o700 {
		t.Errorf("state dir = %v, %v; want mode 0700", info, err)
	}
	if err := o.Set("app", Record{Dir: "/run/app", Medium: "disk", CreatedDir: true}); err != nil {
		t.Fatal(err)
	}
	if err := o.Set("web", Record{Dir: "/run/web", Medium: "disk"}); err != nil {
		t.Fatal(err)
	}
	if err := o.Delete("web"); err != nil {
		t.Fatal(err)
	}
	again, err := LoadOwned(dir)
	if err != nil {
		t.Fatal(err)
	}
	got := again.All()
	if len(got) != 1 || got["app"] != (Record{Dir: "/run/app", Medium: "disk", CreatedDir: true}) {
		t.Errorf("reloaded %v", got)
	}
	if info, err := os.Stat(filepath.Join(dir, ownedFile)); err != nil || info.Mode().Perm() != 0o600 {
		t.Errorf("record file = %v, %v; want mode 0600", info, err)
	}
}

func TestOwnedRejectsCorruptRecord(t *testing.T) {
	dir := t.TempDir()
	for body, want := range map[string]string{
		"{not json":                   "mounts.json",
		`{"version": 9, "mounts":{}}`: "unknown version 9",
	} {
		if err := os.WriteFile(filepath.Join(dir, ownedFile), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadOwned(dir); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("LoadOwned(%q) = %v; want an error containing %q", body, err, want)
		}
	}
}

// TestOwnedConcurrentChanges: changes made at the same time are each on
// disk when their call returns, and they are written together, not one
// write each.
func TestOwnedConcurrentChanges(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	o, err := LoadOwned(dir)
	if err != nil {
		t.Fatal(err)
	}
	const n = 200
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			name := fmt.Sprintf("m%03d", i)
			if err := o.Set(name, Record{Dir: "/run/" + name, Medium: "disk"}); err != nil {
				t.Error(err)
				return
			}
			again, err := LoadOwned(dir)
			if err != nil {
				t.Error(err)
				return
			}
			if _, ok := again.Get(name); !ok {
				t.Errorf("Set(%s) returned before the record on disk held it", name)
			}
		})
	}
	wg.Wait()
	again, err := LoadOwned(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(again.All()); got != n {
		t.Errorf("record on disk holds %d mounts; want %d", got, n)
	}
	o.mu.Lock()
	writes := o.writes
	o.mu.Unlock()
	if writes >= n {
		t.Errorf("%d changes made at once took %d writes; want them written together", n, writes)
	}
	t.Logf("%d changes made at once, %d writes", n, writes)
}

// TestOwnedRetriesAfterAFailedWrite: after a write fails, the same change
// made again is written, not taken as already on disk.
func TestOwnedRetriesAfterAFailedWrite(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	o, err := LoadOwned(dir)
	if err != nil {
		t.Fatal(err)
	}
	// A directory where the record goes: the rename onto it fails.
	blocker := filepath.Join(dir, ownedFile)
	if err := os.Mkdir(blocker, 0o700); err != nil {
		t.Fatal(err)
	}
	rec := Record{Dir: "/run/app", Medium: "disk"}
	if err := o.Set("app", rec); err == nil {
		t.Fatal("Set succeeded with a directory in the record's place")
	}
	if err := os.Remove(blocker); err != nil {
		t.Fatal(err)
	}
	if err := o.Set("app", rec); err != nil {
		t.Fatal(err)
	}
	again, err := LoadOwned(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := again.Get("app"); !ok || got != rec {
		t.Errorf("record on disk holds %v, %v; want the change made again after the failed write", got, ok)
	}
}
