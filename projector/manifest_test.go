package projector

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/internal/roottest"
)

// manifestPayload is a payload with files at two depths.
func manifestPayload() Payload {
	return Payload{
		"app.conf":       file("listen 80\n", 0o644),
		"tls/cert.pem":   file("CERT", 0o644),
		"tls/key.pem":    file("KEY", 0o600),
		"deep/a/b/c.txt": file("c", 0o640),
	}
}

// written writes payload into a new mount directory and returns it with
// the version's path.
func written(t *testing.T, payload Payload) (dir, version string) {
	t.Helper()
	dir = t.TempDir()
	w := newWriter(t, dir)
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	return dir, filepath.Join(dir, w.Version())
}

// adoptAndWrite adopts dir with a new writer, then writes payload, and
// returns the adoption, the change and whether the version stayed.
func adoptAndWrite(t *testing.T, dir string, payload Payload) (Adoption, Change, bool) {
	t.Helper()
	w := newWriter(t, dir)
	ad, err := w.Adopt()
	if err != nil {
		t.Fatal(err)
	}
	change, err := w.Write(payload)
	if err != nil {
		t.Fatal(err)
	}
	checkMount(t, dir, payload)
	return ad, change, w.Version() == ad.Version
}

// TestAdoptFromManifest covers the four cases of a restart's adoption: a
// manifest that matches the disk is used (no file read: a change of bytes
// that keeps size, inode, mode and owner goes unseen until Verify), one
// that does not match is drift, adopted by reading and repaired; a missing
// or torn one falls back to reading, and the next Write adds a manifest
// without touching the version.
func TestAdoptFromManifest(t *testing.T) {
	payload := manifestPayload()

	t.Run("match", func(t *testing.T) {
		dir, _ := written(t, payload)
		ad, change, same := adoptAndWrite(t, dir, payload)
		if !ad.FromManifest || ad.Files != len(payload) || ad.ManifestErr != nil {
			t.Errorf("Adopt = %+v; want from the manifest, %d files", ad, len(payload))
		}
		if !change.Empty() || !same {
			t.Errorf("Write of the same payload changed %+v (same version: %v); want nothing", change, same)
		}
	})

	t.Run("match, then a change", func(t *testing.T) {
		dir, version := written(t, payload)
		next := manifestPayload()
		next["tls/cert.pem"] = file("CERT2", 0o644)
		before := inode(t, filepath.Join(version, "app.conf"))
		ad, change, same := adoptAndWrite(t, dir, next)
		if !ad.FromManifest || same {
			t.Fatalf("Adopt = %+v, version kept %v; want from the manifest, then a new version", ad, same)
		}
		if len(change.Changed) != 1 || change.Changed[0] != "tls/cert.pem" || len(change.Added)+len(change.Removed) != 0 {
			t.Errorf("change %+v; want tls/cert.pem changed", change)
		}
		if got := inode(t, filepath.Join(dir, "app.conf")); got != before {
			t.Errorf("an unchanged file was written again (inode %d, was %d); want it hard-linked", got, before)
		}
	})

	t.Run("mismatch is drift, repaired", func(t *testing.T) {
		dir, version := written(t, payload)
		if err := os.Chmod(filepath.Join(version, "tls/key.pem"), 0o644); err != nil {
			t.Fatal(err)
		}
		ad, change, same := adoptAndWrite(t, dir, payload)
		if ad.FromManifest || !errors.Is(ad.ManifestErr, ErrDrift) {
			t.Errorf("Adopt = %+v; want adopted by reading, the manifest's error ErrDrift", ad)
		}
		if same || len(change.Changed) != 1 || change.Changed[0] != "tls/key.pem" {
			t.Errorf("Write changed %+v (version kept: %v); want tls/key.pem repaired in a new version", change, same)
		}
	})

	t.Run("replaced file is drift", func(t *testing.T) {
		dir, version := written(t, payload)
		p := filepath.Join(version, "app.conf")
		if err := os.WriteFile(p+".new", []byte("listen 80\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(p+".new", p); err != nil {
			t.Fatal(err)
		}
		ad, _, _ := adoptAndWrite(t, dir, payload)
		if ad.FromManifest || !errors.Is(ad.ManifestErr, ErrDrift) {
			t.Errorf("Adopt = %+v; want the new inode found: adopted by reading", ad)
		}
	})

	for name, spoil := range map[string]func(p string) error{
		"missing": os.Remove,
		"torn": func(p string) error {
			info, err := os.Stat(p)
			if err != nil {
				return err
			}
			return os.Truncate(p, info.Size()/2)
		},
		"entries edited": func(p string) error {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			var m manifest
			if err := json.Unmarshal(data, &m); err != nil {
				return err
			}
			m.Files[0].Size++ // valid JSON, but not its digest
			data, err = json.Marshal(&m)
			if err != nil {
				return err
			}
			return os.WriteFile(p, data, 0o600)
		},
		"not kvmount's": func(p string) error { return os.Chown(p, 65534, 65534) },
	} {
		t.Run(name+" falls back to reading", func(t *testing.T) {
			dir, version := written(t, payload)
			if err := spoil(manifestPath(dir, version)); err != nil {
				t.Fatal(err)
			}
			ad, change, same := adoptAndWrite(t, dir, payload)
			if ad.FromManifest || !errors.Is(ad.ManifestErr, errNoManifest) || ad.Files != len(payload) {
				t.Errorf("Adopt = %+v; want adopted by reading, the manifest's error errNoManifest", ad)
			}
			if !change.Empty() || !same {
				t.Errorf("Write changed %+v (version kept: %v); want nothing, and a manifest added (checkMount)", change, same)
			}
		})
	}
}

// TestManifestLeavesBytesToVerify edits a file in place, keeping its size,
// inode, mode and owner: adoption from the manifest does not read it —
// what makes a restart cost O(files) — and Verify, which reads every byte,
// finds it and the next Write repairs it.
func TestManifestLeavesBytesToVerify(t *testing.T) {
	payload := manifestPayload()
	dir, version := written(t, payload)
	if err := os.WriteFile(filepath.Join(version, "app.conf"), []byte("listen 81\n"), 0); err != nil {
		t.Fatal(err)
	}
	w := newWriter(t, dir)
	ad, err := w.Adopt()
	if err != nil || !ad.FromManifest {
		t.Fatalf("Adopt = %+v, %v; want from the manifest", ad, err)
	}
	if change, err := w.Write(payload); err != nil || !change.Empty() {
		t.Fatalf("Write = %+v, %v; want nothing changed", change, err)
	}
	if err := w.Verify(); !errors.Is(err, ErrDrift) {
		t.Fatalf("Verify = %v; want ErrDrift", err)
	}
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	checkMount(t, dir, payload)
}

// TestVerifyRestoresTheManifest removes and spoils the manifest of a
// current version: Verify finds the content intact, reports no drift,
// and writes the manifest again so that the next start can use it.
func TestVerifyRestoresTheManifest(t *testing.T) {
	payload := manifestPayload()
	dir := t.TempDir()
	w := newWriter(t, dir)
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	m := manifestPath(dir, w.Version())
	for _, spoil := range []func() error{
		func() error { return os.Remove(m) },
		func() error { return os.WriteFile(m, []byte(`{"format":"kvmount-manifest/1"}`), 0o600) },
	} {
		if err := spoil(); err != nil {
			t.Fatal(err)
		}
		if err := w.Verify(); err != nil {
			t.Fatalf("Verify = %v; want no drift", err)
		}
		checkMount(t, dir, payload)
	}
}

// TestPeekDigest reads the digest from the manifest's head: the payload's
// digest, and nothing for a mount without a manifest or without a version.
func TestPeekDigest(t *testing.T) {
	payload := manifestPayload()
	dir, version := written(t, payload)
	if got, ok := PeekDigest(dir, manifestDir(t, dir)); !ok || got != payload.Digest() {
		t.Errorf("PeekDigest = %q, %v; want %q", got, ok, payload.Digest())
	}
	other := manifestPayload()
	other["app.conf"] = file("listen 81\n", 0o644)
	if other.Digest() == payload.Digest() {
		t.Error("two payloads have the same digest")
	}
	if err := os.Remove(manifestPath(dir, version)); err != nil {
		t.Fatal(err)
	}
	if got, ok := PeekDigest(dir, manifestDir(t, dir)); ok {
		t.Errorf("PeekDigest without a manifest = %q; want none", got)
	}
	if got, ok := PeekDigest(t.TempDir(), manifestDir(t, dir)); ok {
		t.Errorf("PeekDigest of an empty directory = %q; want none", got)
	}
}

// TestMountHoldsTheKubeletsLayoutOnly is issue 25's fourth finding: the
// manifest lives outside the mount, so that a real unprivileged user who
// owns the payload and reads every entry under ..data (find -type f, as a
// recursive config loader does) meets payload files only, all readable —
// where a root-owned ..manifest beside them made it fail with EACCES.
func TestMountHoldsTheKubeletsLayoutOnly(t *testing.T) {
	u := roottest.NewUser(t)
	dir := filepath.Join(roottest.TempDir(t), "mount")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	w, err := OpenAtomicWriter(dir, WriterOptions{Sync: true, ManifestDir: manifestDir(t, dir), DirUID: u.UID, DirGID: u.GID, DirMode: 0o700})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	owned := func(data string) File { return File{Data: []byte(data), Mode: 0o400, UID: u.UID, GID: u.GID} }
	for _, payload := range []Payload{
		{"app.conf": owned("a"), "tls/key.pem": owned("k")},
		{"app.conf": owned("b"), "tls/key.pem": owned("k"), "extra/x": owned("x")},
	} {
		if _, err := w.Write(payload); err != nil {
			t.Fatal(err)
		}
		out := u.Run(t, fmt.Sprintf("cd %s/..data/ && find . -type f | sort && find . -type f -exec cat {} +", dir))
		var want []string
		for _, p := range payload.Paths() {
			want = append(want, "./"+p)
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if got := strings.Join(lines[:len(lines)-1], "\n"); got != strings.Join(want, "\n") {
			t.Errorf("find -type f under ..data as the mount's user:\n%s\nwant only the payload:\n%s", got, strings.Join(want, "\n"))
		}
		var version []string
		for _, e := range mustReadDir(t, filepath.Join(dir, w.Version())) {
			version = append(version, e.Name())
		}
		for _, name := range version {
			if strings.HasPrefix(name, "..") {
				t.Errorf("version %s holds %s", w.Version(), name)
			}
		}
	}
	// The manifests are root's, beside the mount, one per version kept.
	if _, err := os.Stat(manifestPath(dir, w.Version())); err != nil {
		t.Errorf("the current version's manifest: %v", err)
	}
}

// mustReadDir lists dir.
func mustReadDir(t *testing.T, dir string) []os.DirEntry {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	return entries
}

// TestLegacyManifestMovesOut: a version an older kvmount wrote, with its
// ..manifest inside, is adopted by reading; the next write that finds it
// unchanged keeps the version, writes its manifest beside the mount and
// removes the one inside.
func TestLegacyManifestMovesOut(t *testing.T) {
	payload := manifestPayload()
	dir, version := written(t, payload)
	if err := os.Rename(manifestPath(dir, version), filepath.Join(version, legacyManifestName)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(version, legacyManifestTmpName), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	ad, change, same := adoptAndWrite(t, dir, payload)
	if ad.FromManifest || !errors.Is(ad.ManifestErr, errNoManifest) || !change.Empty() || !same {
		t.Errorf("Adopt = %+v, change %+v, version kept %v; want adopted by reading, nothing written", ad, change, same)
	}
	for _, legacy := range []string{legacyManifestName, legacyManifestTmpName} {
		if _, err := os.Lstat(filepath.Join(version, legacy)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s is still in the version: %v", legacy, err)
		}
	}
}

// TestOrphanManifestsArePruned: adoption removes the manifests of versions
// that are gone and the temporary files of an interrupted addManifest, and
// keeps the current version's.
func TestOrphanManifestsArePruned(t *testing.T) {
	payload := manifestPayload()
	dir, version := written(t, payload)
	md := manifestDir(t, dir)
	for _, name := range []string{"2020_01_01_00_00_00.000000001", "2020_01_01_00_00_00.000000002.tmp", manifestFile(filepath.Base(version)) + ".tmp"} {
		if err := os.WriteFile(filepath.Join(md, name), []byte("{}"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	ad, _, _ := adoptAndWrite(t, dir, payload)
	if !ad.FromManifest {
		t.Errorf("Adopt = %+v; want from the manifest", ad)
	}
	var left []string
	for _, e := range mustReadDir(t, md) {
		left = append(left, e.Name())
	}
	if want := []string{manifestFile(filepath.Base(version))}; !slices.Equal(left, want) {
		t.Errorf("manifest directory holds %v; want %v", left, want)
	}
}

// TestDigestFormat pins the payload digest's format: the digests of two
// payloads as every version since the manifest's first format computed
// them. The manifests already on disk record them; a digest computed
// another way would find every mount changed after an upgrade and every
// manifest torn, and make a restart rewrite all of them.
func TestDigestFormat(t *testing.T) {
	small := Payload{
		"app.conf":    {Data: []byte("listen 80\n"), Mode: 0o644, UID: 0, GID: 0},
		"tls/key.pem": {Data: []byte("KEY"), Mode: 0o600, UID: 1000, GID: 1001},
		"deep/a/b/c":  {Mode: 0o640, UID: 65534, GID: 65534},
	}
	big := payloadOf(100, 100, 4)
	for name, f := range big {
		f.UID, f.GID = 0, 0
		big[name] = f
	}
	for _, tc := range []struct {
		payload Payload
		want    string
	}{
		{small, "a80ef76d59dfe87d6e202b07ca7de2c9f088559105bc5ad04ebd4ef2dd65e00e"},
		{big, "095880a5a5107c31449490b0caacb86fdd33a62b88c6784a06353657ebe18cf7"},
	} {
		if got := tc.payload.Digest(); got != tc.want {
			t.Errorf("Digest of %d files = %s; want %s", len(tc.payload), got, tc.want)
		}
		entries := make([]manifestEntry, 0, len(tc.payload))
		for _, p := range tc.payload.Paths() {
			entries = append(entries, entryOf(p, tc.payload[p]))
		}
		if got := payloadDigest(entries); got != tc.want {
			t.Errorf("digest of the manifest entries of %d files = %s; want %s", len(tc.payload), got, tc.want)
		}
	}
}

// TestKeepWithoutThePayload: a version adopted from its manifest is kept
// as the projection of its payload's digest without the payload (a
// restart whose worker found the payload unchanged): the mount is as
// Write of the payload leaves it — a visible symlink removed while
// kvmount was down is back, a stray one of the writer's gone — and the
// version stays. Any other case needs the bytes: another digest, a
// version adopted by reading (drift), or no version at all.
func TestKeepWithoutThePayload(t *testing.T) {
	payload := manifestPayload()

	t.Run("kept", func(t *testing.T) {
		dir, _ := written(t, payload)
		if err := os.Remove(filepath.Join(dir, "tls")); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(filepath.Join(DataDirName, "gone"), filepath.Join(dir, "gone")); err != nil {
			t.Fatal(err)
		}
		w := newWriter(t, dir)
		ad, err := w.Adopt()
		if err != nil {
			t.Fatal(err)
		}
		if !ad.FromManifest {
			t.Fatalf("Adopt = %+v; want from the manifest", ad)
		}
		if got := w.Size(); got != payload.Size() {
			t.Errorf("Size = %d; want %d, the manifest's", got, payload.Size())
		}
		if err := w.Keep(payload.Digest()); err != nil {
			t.Fatal(err)
		}
		checkMount(t, dir, payload)
		if w.Version() != ad.Version {
			t.Errorf("version %s after Keep; want %s kept", w.Version(), ad.Version)
		}
		if _, err := os.Lstat(filepath.Join(dir, "gone")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("the stale visible symlink stayed (%v)", err)
		}
		// What Keep kept is written on as any adopted version.
		next := manifestPayload()
		next["app.conf"] = file("listen 81\n", 0o644)
		if change, err := w.Write(next); err != nil || len(change.Changed) != 1 {
			t.Fatalf("Write after Keep = %+v, %v; want app.conf changed", change, err)
		}
		checkMount(t, dir, next)
	})

	t.Run("another digest", func(t *testing.T) {
		dir, version := written(t, payload)
		w := newWriter(t, dir)
		if _, err := w.Adopt(); err != nil {
			t.Fatal(err)
		}
		other := manifestPayload()
		other["app.conf"] = file("listen 81\n", 0o644)
		for _, digest := range []string{other.Digest(), ""} {
			if err := w.Keep(digest); !errors.Is(err, ErrNotKept) {
				t.Errorf("Keep(%q) = %v; want ErrNotKept", digest, err)
			}
		}
		if w.Version() != filepath.Base(version) {
			t.Errorf("version %s; want %s untouched", w.Version(), filepath.Base(version))
		}
	})

	t.Run("drift needs the bytes", func(t *testing.T) {
		dir, version := written(t, payload)
		if err := os.Chmod(filepath.Join(version, "tls/key.pem"), 0o644); err != nil {
			t.Fatal(err)
		}
		w := newWriter(t, dir)
		if ad, err := w.Adopt(); err != nil || ad.FromManifest {
			t.Fatalf("Adopt = %+v, %v; want adopted by reading", ad, err)
		}
		if err := w.Keep(payload.Digest()); !errors.Is(err, ErrNotKept) {
			t.Errorf("Keep after drift = %v; want ErrNotKept", err)
		}
	})

	t.Run("nothing adopted", func(t *testing.T) {
		w := newWriter(t, t.TempDir())
		if _, err := w.Adopt(); err != nil {
			t.Fatal(err)
		}
		if err := w.Keep(payload.Digest()); !errors.Is(err, ErrNotKept) {
			t.Errorf("Keep of an empty mount = %v; want ErrNotKept", err)
		}
		if got := w.Size(); got != -1 {
			t.Errorf("Size of an empty mount = %d; want -1", got)
		}
	})
}
