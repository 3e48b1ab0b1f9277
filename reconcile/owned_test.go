package reconcile

import (
	"os"
	"path/filepath"
	"strings"
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
