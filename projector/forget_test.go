package projector

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"
)

// TestForgetPayload: a writer that forgot its payload after a write
// (ForgetPayload) still counts the current version's files and knows its
// digest (from the manifest, as it wrote it), tells what
// the next write changes, hard-links the files that stay, writes nothing
// for an equal payload, and verifies every byte against the manifest's
// hashes — an edit in place of the same size is drift.
func TestForgetPayload(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	first := Payload{"a": file("1", 0o644), "d/b": file("2", 0o644), "c": file("3", 0o600)}
	if _, err := w.Write(first); err != nil {
		t.Fatal(err)
	}
	if w.Digest() != first.Digest() {
		t.Errorf("Digest = %q after a write; want the payload's, %q", w.Digest(), first.Digest())
	}
	if !w.ForgetPayload() {
		t.Fatal("ForgetPayload = false for a version with a manifest")
	}
	if w.Digest() != first.Digest() {
		t.Errorf("Digest = %q once forgotten; want the payload's, %q", w.Digest(), first.Digest())
	}
	if w.Files() != 3 {
		t.Errorf("Files = %d after ForgetPayload; want 3", w.Files())
	}
	if err := w.Verify(); err != nil {
		t.Fatalf("Verify of an untouched forgotten version: %v", err)
	}
	w.ForgetPayload()
	kept := inode(t, filepath.Join(dir, "d", "b"))
	second := Payload{"a": file("one", 0o644), "d/b": file("2", 0o644), "e": file("4", 0o644)}
	change, err := w.Write(second)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(change.Changed, []string{"a"}) || !slices.Equal(change.Added, []string{"e"}) || !slices.Equal(change.Removed, []string{"c"}) {
		t.Errorf("change %+v; want a changed, e added, c removed", change)
	}
	if got := inode(t, filepath.Join(dir, "d", "b")); got != kept {
		t.Errorf("d/b written anew (inode %d, was %d); want it hard-linked from the forgotten version", got, kept)
	}
	checkMount(t, dir, second)
	if w.Digest() != second.Digest() {
		t.Errorf("Digest = %q after the second write; want %q", w.Digest(), second.Digest())
	}
	w.ForgetPayload()
	version := w.Version()
	if change, err := w.Write(second); err != nil || !change.Empty() || w.Version() != version {
		t.Errorf("an equal payload over a forgotten version: change %+v, %v, version %s (was %s); want nothing written", change, err, w.Version(), version)
	}

	w.ForgetPayload()
	if err := os.WriteFile(filepath.Join(dir, DataDirName, "a"), []byte("ONE"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := w.Verify(); !errors.Is(err, ErrDrift) {
		t.Fatalf("Verify after an edit in place of the same size = %v; want ErrDrift", err)
	}
	if _, err := w.Write(second); err != nil {
		t.Fatal(err)
	}
	checkMount(t, dir, second)
}

// TestForgottenManifestLost: a forgotten version whose manifest was
// removed by hand is unknown: Verify reports drift, and the next write
// writes every file and leaves no other version behind.
func TestForgottenManifestLost(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	p := Payload{"a": file("1", 0o644)}
	if _, err := w.Write(p); err != nil {
		t.Fatal(err)
	}
	w.ForgetPayload()
	if err := os.Remove(filepath.Join(manifestDir(t, dir), manifestFile(w.Version()))); err != nil {
		t.Fatal(err)
	}
	if err := w.Verify(); !errors.Is(err, ErrDrift) {
		t.Fatalf("Verify without the forgotten version's manifest = %v; want ErrDrift", err)
	}
	next := Payload{"a": file("1", 0o644), "b": file("2", 0o644)}
	if _, err := w.Write(next); err != nil {
		t.Fatal(err)
	}
	checkMount(t, dir, next)
}

// TestForgottenPayloadReleased: once forgotten, neither the current
// version's payload nor a replaced one's is held by the writer.
func TestForgottenPayloadReleased(t *testing.T) {
	_, w := graceWriter(t)
	released := make(chan struct{}, 2)
	for i, data := range []string{"first", "second"} {
		b := make([]byte, 1<<16)
		copy(b, data)
		runtime.AddCleanup(&b[0], func(ch chan struct{}) { ch <- struct{}{} }, released)
		if _, err := w.Write(Payload{"a": {Data: b, Mode: 0o644, UID: os.Geteuid(), GID: os.Getegid()}}); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			continue
		}
		if !w.ForgetPayload() {
			t.Fatal("ForgetPayload = false")
		}
	}
	got := 0
	for range 50 {
		runtime.GC()
		select {
		case <-released:
			if got++; got == 2 {
				return
			}
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Errorf("%d of 2 payloads released after ForgetPayload and 50 collections; want both (the current and the replaced one)", got)
}
