package projector

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
)

// file returns a payload file owned by the test process.
func file(data string, mode fs.FileMode) File {
	return File{Data: []byte(data), Mode: mode, UID: os.Geteuid(), GID: os.Getegid()}
}

// manifestDir returns the directory where the tests' writers of the mount
// directory dir keep their manifests, beside it, creating it.
func manifestDir(t testing.TB, dir string) string {
	t.Helper()
	md := dir + ".manifests"
	if err := os.MkdirAll(md, 0o700); err != nil {
		t.Fatal(err)
	}
	return md
}

// manifestPath returns the path of the manifest of version in the mount
// directory dir.
func manifestPath(dir, version string) string {
	return filepath.Join(dir+".manifests", manifestFile(filepath.Base(version)))
}

func newWriter(t *testing.T, dir string) *AtomicWriter {
	t.Helper()
	w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(t, dir), Sync: true, DirUID: -1, DirGID: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

// checkMount asserts that dir holds exactly want in the atomic writer's
// layout: the version directory behind ..data and at most MaxRetired
// replaced versions kept for readers (WriterOptions.Grace), no ..data_tmp,
// one visible
// symlink per first path element, and every file readable through it with
// the right bytes and mode.
func checkMount(t *testing.T, dir string, want Payload) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	target, err := os.Readlink(filepath.Join(dir, DataDirName))
	if len(want) == 0 && errors.Is(err, fs.ErrNotExist) {
		if len(entries) != 0 {
			t.Fatalf("empty mount holds %v", names(entries))
		}
		return
	}
	if err != nil {
		t.Fatalf("readlink ..data: %v", err)
	}
	visible := topLevel(want)
	var versions []string
	for _, e := range entries {
		switch name := e.Name(); {
		case name == DataDirName:
		case isVersionName(name):
			versions = append(versions, name)
		case visible[name]:
			got, err := os.Readlink(filepath.Join(dir, name))
			if err != nil || got != DataDirName+"/"+name {
				t.Errorf("visible entry %s -> %q, %v; want ..data/%s", name, got, err, name)
			}
			delete(visible, name)
		default:
			t.Errorf("unexpected entry %s", name)
		}
	}
	if len(visible) != 0 {
		t.Errorf("missing visible entries %v", slices.Sorted(maps.Keys(visible)))
	}
	if len(versions) > MaxRetired+1 || !slices.Contains(versions, target) {
		t.Errorf("version directories %v, ..data -> %s; want the one ..data names and at most %d replaced", versions, target, MaxRetired)
	}
	got := Payload{}
	root := filepath.Join(dir, target)
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if !strings.Contains(rel, "/") && strings.HasPrefix(rel, "..") {
			t.Errorf("the version holds %s: a mount holds the kubelet's layout and nothing else", rel)
			return nil
		}
		// Read through the visible symlink, as a reader would.
		data, err := os.ReadFile(filepath.Join(dir, rel))
		if err != nil {
			return err
		}
		info, err := os.Stat(filepath.Join(dir, rel))
		if err != nil {
			return err
		}
		st := info.Sys().(*syscall.Stat_t)
		got[rel] = File{Data: data, Mode: info.Mode().Perm(), UID: int(st.Uid), GID: int(st.Gid)}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !got.Equal(want) {
		t.Errorf("mount holds %v; want %v", describe(got), describe(want))
	}
	checkManifest(t, manifestPath(dir, target), root, want)
}

// checkManifest asserts that the manifest at path, readable by its owner
// only, records want, with the inode of each file of the version directory
// root, and adds up to its digest.
func checkManifest(t *testing.T, path, root string, want Payload) {
	t.Helper()
	info, err := os.Lstat(path)
	if err != nil {
		t.Fatalf("manifest: %v", err)
	}
	if info.Mode() != 0o600 {
		t.Errorf("manifest mode %v; want -rw-------", info.Mode())
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m manifest
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatalf("manifest: %v", err)
	}
	if m.Format != manifestFormat || m.Digest != want.Digest() || m.Digest != payloadDigest(m.Files) {
		t.Errorf("manifest format %q digest %s (of its entries %s); want %q, %s", m.Format, m.Digest, payloadDigest(m.Files), manifestFormat, want.Digest())
	}
	if len(m.Files) != len(want) {
		t.Errorf("manifest has %d entries; want %d", len(m.Files), len(want))
	}
	for _, e := range m.Files {
		f, ok := want[e.Path]
		if !ok || !e.sameFile(f) {
			t.Errorf("manifest entry %+v does not record %q", e, e.Path)
			continue
		}
		if ino := inode(t, filepath.Join(root, e.Path)); ino != e.Ino {
			t.Errorf("manifest: %s has inode %d; the disk %d", e.Path, e.Ino, ino)
		}
	}
}

func names(entries []fs.DirEntry) []string {
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	return out
}

func describe(p Payload) []string {
	var out []string
	for _, name := range p.Paths() {
		out = append(out, name+"="+string(p[name].Data)+"@"+p[name].Mode.String())
	}
	return out
}

func inode(t *testing.T, path string) uint64 {
	t.Helper()
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return info.Sys().(*syscall.Stat_t).Ino
}

func TestWriteOnce(t *testing.T) {
	tests := []struct {
		name    string
		payload Payload
		want    Payload // nil: same as payload
		wantErr string
	}{
		{name: "invalid absolute", payload: Payload{"/etc/passwd": file("x", 0o644)}, wantErr: "relative"},
		{name: "invalid dot-dot", payload: Payload{"foo/../../x": file("x", 0o644)}, wantErr: "'..'"},
		{name: "invalid reserved", payload: Payload{"..data": file("x", 0o644)}, wantErr: "'..'"},
		{name: "invalid NUL", payload: Payload{"a\x00": file("x", 0o644)}, wantErr: "NUL"},
		{name: "invalid one of many", payload: Payload{"good": file("x", 0o644), "../bad": file("y", 0o644)}, wantErr: "'..'"},
		{name: "file and directory", payload: Payload{"a": file("x", 0o644), "a/b": file("y", 0o644)}, wantErr: "both a file and a directory"},
		{name: "paths that clean alike", payload: Payload{"a//b": file("x", 0o644), "a/b": file("y", 0o644)}, wantErr: "cleans to"},
		{name: "empty payload", payload: Payload{}},
		{name: "one file", payload: Payload{"foo": file("foo", 0o644)}},
		{name: "binary", payload: Payload{"bin": {Data: []byte{0, 1, 2, 0xff, 0xfe, '\n', 0}, Mode: 0o644, UID: os.Geteuid(), GID: os.Getegid()}}},
		{name: "dotfiles", payload: Payload{".dotfile": file("dot", 0o644), ".dotdir/.dotfile": file("dotdir", 0o644), "foo/..bar": file("x", 0o644)}},
		{name: "modes", payload: Payload{
			"r": file("0400", 0o400), "rwx": file("0777", 0o777), "odd": file("0407", 0o407),
			"ro-group": file("0440", 0o440), "rw-all": file("0666", 0o666),
		}},
		{name: "unclean paths are cleaned", payload: Payload{"foo//bar": file("x", 0o644), "./baz/": file("y", 0o644)},
			want: Payload{"foo/bar": file("x", 0o644), "baz": file("y", 0o644)}},
		{name: "deep nesting", payload: Payload{
			"a/b/c/d/e/f/g/h/i/j/k": file("deep", 0o644), "a/b/other": file("other", 0o600), "top": file("top", 0o644),
		}},
		{name: "spaces and unicode", payload: Payload{"with space/ünï cödé": file("u", 0o644)}},
		{name: "empty file", payload: Payload{"empty": file("", 0o644)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			w := newWriter(t, dir)
			change, err := w.Write(tt.payload)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Write = %v; want error containing %q", err, tt.wantErr)
				}
				checkMount(t, dir, nil)
				return
			}
			if err != nil {
				t.Fatalf("Write: %v", err)
			}
			want := tt.want
			if want == nil {
				want = tt.payload
			}
			checkMount(t, dir, want)
			if got, wantN := len(change.Added), len(want); got != wantN {
				t.Errorf("change added %d files; want %d", got, wantN)
			}
		})
	}
}

func TestUpdateSequences(t *testing.T) {
	type step struct {
		payload     Payload
		wantChanged bool
	}
	a := file("a", 0o644)
	b := file("b", 0o644)
	c := file("c", 0o644)
	d := file("d", 0o644)
	tests := []struct {
		name  string
		steps []step
	}{
		{name: "update", steps: []step{
			{Payload{"foo": a, "bar": b}, true},
			{Payload{"foo": c, "bar": b}, true},
		}},
		{name: "no-op", steps: []step{
			{Payload{"foo": a, "dir/bar": b}, true},
			{Payload{"foo": a, "dir/bar": b}, false},
		}},
		{name: "add deep", steps: []step{
			{Payload{"foo": a}, true},
			{Payload{"foo": a, "x/y/z/deep": b}, true},
		}},
		{name: "delete one", steps: []step{
			{Payload{"foo": a, "bar": b}, true},
			{Payload{"foo": a}, true},
		}},
		{name: "delete nested one", steps: []step{
			{Payload{"dir/foo": a, "dir/bar": b}, true},
			{Payload{"dir/foo": a}, true},
		}},
		{name: "delete whole subtree", steps: []step{
			{Payload{"dir/sub/foo": a, "dir/bar": b, "top": c}, true},
			{Payload{"top": c}, true},
		}},
		{name: "delete four", steps: []step{
			{Payload{"a": a, "b": b, "c": c, "d/e": d, "keep": a}, true},
			{Payload{"keep": a}, true},
		}},
		{name: "delete all", steps: []step{
			{Payload{"foo": a, "dir/bar": b}, true},
			{Payload{}, true},
		}},
		{name: "add and delete", steps: []step{
			{Payload{"foo": a, "bar": b}, true},
			{Payload{"foo": a, "baz/qux": c}, true},
			{Payload{"bar": b}, true},
		}},
		{name: "mode-only change", steps: []step{
			{Payload{"secret": file("s", 0o644)}, true},
			{Payload{"secret": file("s", 0o400)}, true},
		}},
		{name: "file becomes directory", steps: []step{
			{Payload{"a": a}, true},
			{Payload{"a/b": b}, true},
			{Payload{"a": c}, true},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			w := newWriter(t, dir)
			var prev Payload
			for i, s := range tt.steps {
				before := w.Version()
				change, err := w.Write(s.payload)
				if err != nil {
					t.Fatalf("step %d: Write: %v", i, err)
				}
				if change.Empty() == s.wantChanged {
					t.Errorf("step %d: change %+v; want changed=%v", i, change, s.wantChanged)
				}
				if !s.wantChanged && w.Version() != before {
					t.Errorf("step %d: version %s replaced %s without a change", i, w.Version(), before)
				}
				if want := Diff(prev, s.payload); !slices.Equal(change.Removed, want.Removed) {
					t.Errorf("step %d: removed %v; want %v", i, change.Removed, want.Removed)
				}
				checkMount(t, dir, s.payload)
				prev = s.payload
			}
		})
	}
}

func TestUnchangedFilesAreHardLinked(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	if _, err := w.Write(Payload{"same": file("same", 0o644), "dir/same": file("x", 0o600), "changes": file("1", 0o644)}); err != nil {
		t.Fatal(err)
	}
	same, nested, changes := inode(t, filepath.Join(dir, "same")), inode(t, filepath.Join(dir, "dir/same")), inode(t, filepath.Join(dir, "changes"))
	if _, err := w.Write(Payload{"same": file("same", 0o644), "dir/same": file("x", 0o600), "changes": file("2", 0o644)}); err != nil {
		t.Fatal(err)
	}
	if got := inode(t, filepath.Join(dir, "same")); got != same {
		t.Errorf("unchanged file has inode %d; want %d (hard link)", got, same)
	}
	if got := inode(t, filepath.Join(dir, "dir/same")); got != nested {
		t.Errorf("unchanged nested file has inode %d; want %d (hard link)", got, nested)
	}
	if got := inode(t, filepath.Join(dir, "changes")); got == changes {
		t.Errorf("changed file kept inode %d; want a new file", got)
	}
}

// TestWriteAgainAfterVisibleLinksDeleted is the kubelet's regression for an
// unexpected exit between the switch and the visible symlinks
// (kubernetes#121472): a write without changes must re-create them.
func TestWriteAgainAfterVisibleLinksDeleted(t *testing.T) {
	dir := t.TempDir()
	payload := Payload{"foo": file("foo", 0o644), "dir/bar": file("bar", 0o644)}
	w := newWriter(t, dir)
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"foo", "dir"} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	// A new writer, as after a restart.
	w2 := newWriter(t, dir)
	change, err := w2.Write(payload)
	if err != nil {
		t.Fatal(err)
	}
	if !change.Empty() {
		t.Errorf("change %+v; want none", change)
	}
	checkMount(t, dir, payload)
}

func TestAdoptRemovesCrashLeftovers(t *testing.T) {
	dir := t.TempDir()
	payload := Payload{"foo": file("foo", 0o644)}
	w := newWriter(t, dir)
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	current := w.Version()
	// What a crash can leave: a half-built version and a ..data_tmp that
	// points at it, plus an orphan from an even older crash.
	for _, orphan := range []string{"..2026_01_02_03_04_05.000000001", "..2026_01_02_03_04_06.000000002"} {
		if err := os.MkdirAll(filepath.Join(dir, orphan, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, orphan, "sub", "half"), []byte("half"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("..2026_01_02_03_04_06.000000002", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	w2 := newWriter(t, dir)
	got, err := w2.Adopt()
	if err != nil {
		t.Fatal(err)
	}
	if got.Version != current || got.Files != len(payload) || !got.FromManifest {
		t.Errorf("adopted %+v; want version %s, %d files, from its manifest", got, current, len(payload))
	}
	if w2.Version() != current {
		t.Errorf("adopted version %s; want %s", w2.Version(), current)
	}
	checkMount(t, dir, payload)
	change, err := w2.Write(payload)
	if err != nil || !change.Empty() || w2.Version() != current {
		t.Errorf("Write after adopt = %+v, %v, version %s; want no change to %s", change, err, w2.Version(), current)
	}
}

// TestWriteRemovesLeftoversAmongManyNames: a writer's first switch
// removes the leftovers it finds then — version directories and
// ..data_tmp that appeared after its adoption found the directory empty —
// from a mount directory whose listing takes several reads (1,000 visible
// names, each a directory entry of 24–32 bytes, against listHidden's
// 8 KiB), and nothing else.
func TestWriteRemovesLeftoversAmongManyNames(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	if _, err := w.Adopt(); err != nil {
		t.Fatal(err)
	}
	// Twenty, so that some are beyond the listing's first read in any
	// order the file system lists them in (ext4: by hash).
	var leftovers []string
	for i := range 20 {
		orphan := fmt.Sprintf("..2026_01_02_03_04_05.%09d", i)
		if err := os.MkdirAll(filepath.Join(dir, orphan, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		leftovers = append(leftovers, orphan)
	}
	if err := os.Symlink(leftovers[0], filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	leftovers = append(leftovers, "..data_tmp")
	payload := Payload{}
	for i := range 1000 {
		payload[fmt.Sprintf("key-%04d", i)] = file("v", 0o644)
	}
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	for _, gone := range leftovers {
		if _, err := os.Lstat(filepath.Join(dir, gone)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after the write: %v; want it removed", gone, err)
		}
	}
	checkMount(t, dir, payload)
	names, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	// The visible names, ..data and the version.
	if len(names) != len(payload)+2 {
		t.Errorf("%d names in the mount; want %d", len(names), len(payload)+2)
	}
}

// TestAdoptAfterCrashBeforeFirstSwitch covers a crash during the very first
// write: a version directory exists but ..data does not.
func TestAdoptAfterCrashBeforeFirstSwitch(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "..2026_01_02_03_04_05.000000001"), 0o755); err != nil {
		t.Fatal(err)
	}
	w := newWriter(t, dir)
	got, err := w.Adopt()
	if err != nil || got.Version != "" {
		t.Fatalf("Adopt = %+v, %v; want no version, no error", got, err)
	}
	checkMount(t, dir, nil)
}

func TestRefusesForeignContent(t *testing.T) {
	tests := []struct {
		name  string
		setup func(dir string) error
	}{
		{name: "regular file", setup: func(dir string) error {
			return os.WriteFile(filepath.Join(dir, "app.conf"), []byte("mine"), 0o644)
		}},
		{name: "directory", setup: func(dir string) error { return os.Mkdir(filepath.Join(dir, "sub"), 0o755) }},
		{name: "symlink elsewhere", setup: func(dir string) error { return os.Symlink("/etc", filepath.Join(dir, "etc")) }},
		{name: "unknown reserved name", setup: func(dir string) error { return os.Mkdir(filepath.Join(dir, "..mine"), 0o755) }},
		{name: "..data that is a directory", setup: func(dir string) error { return os.Mkdir(filepath.Join(dir, "..data"), 0o755) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			if err := tt.setup(dir); err != nil {
				t.Fatal(err)
			}
			before, _ := os.ReadDir(dir)
			w := newWriter(t, dir)
			if _, err := w.Write(Payload{"foo": file("foo", 0o644)}); !errors.Is(err, ErrForeignContent) {
				t.Fatalf("Write = %v; want ErrForeignContent", err)
			}
			after, _ := os.ReadDir(dir)
			if !slices.Equal(names(before), names(after)) {
				t.Errorf("directory changed from %v to %v", names(before), names(after))
			}
		})
	}
}

func TestVerifyFindsAndWriteRepairsDrift(t *testing.T) {
	payload := Payload{"foo": file("foo", 0o644), "dir/bar": file("bar", 0o600)}
	tests := []struct {
		name  string
		drift func(dir string) error
	}{
		{name: "visible symlink removed", drift: func(dir string) error { return os.Remove(filepath.Join(dir, "foo")) }},
		{name: "..data removed", drift: func(dir string) error { return os.Remove(filepath.Join(dir, "..data")) }},
		{name: "file removed", drift: func(dir string) error { return os.Remove(filepath.Join(dir, "dir", "bar")) }},
		{name: "file edited in place", drift: func(dir string) error {
			return os.WriteFile(filepath.Join(dir, "foo"), []byte("edited"), 0o644)
		}},
		{name: "mode changed", drift: func(dir string) error { return os.Chmod(filepath.Join(dir, "foo"), 0o666) }},
		{name: "extra file in version", drift: func(dir string) error {
			return os.WriteFile(filepath.Join(dir, "..data", "extra"), nil, 0o644)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			w := newWriter(t, dir)
			if _, err := w.Write(payload); err != nil {
				t.Fatal(err)
			}
			if err := w.Verify(); err != nil {
				t.Fatalf("Verify before drift: %v", err)
			}
			if err := tt.drift(dir); err != nil {
				t.Fatal(err)
			}
			if err := w.Verify(); !errors.Is(err, ErrDrift) {
				t.Fatalf("Verify = %v; want ErrDrift", err)
			}
			if _, err := w.Write(payload); err != nil {
				t.Fatalf("Write after drift: %v", err)
			}
			checkMount(t, dir, payload)
			if err := w.Verify(); err != nil {
				t.Errorf("Verify after repair: %v", err)
			}
		})
	}
}

// TestPlantedSymlinkIsNeverFollowed plants a symlink to a file outside the
// mount where a payload file lives; the writer must replace the version, not
// write through the link.
func TestPlantedSymlinkIsNeverFollowed(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "mount")
	outside := filepath.Join(base, "outside")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(outside, []byte("precious"), 0o644); err != nil {
		t.Fatal(err)
	}
	w := newWriter(t, dir)
	if _, err := w.Write(Payload{"foo": file("v1", 0o644)}); err != nil {
		t.Fatal(err)
	}
	version := filepath.Join(dir, w.Version())
	if err := os.Remove(filepath.Join(version, "foo")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(version, "foo")); err != nil {
		t.Fatal(err)
	}
	if err := w.Verify(); !errors.Is(err, ErrDrift) {
		t.Fatalf("Verify = %v; want ErrDrift", err)
	}
	if _, err := w.Write(Payload{"foo": file("v2", 0o600)}); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(outside)
	if err != nil || string(got) != "precious" {
		t.Errorf("outside file = %q, %v; want it untouched", got, err)
	}
	if info, _ := os.Stat(outside); info.Mode().Perm() != 0o644 {
		t.Errorf("outside file mode %v; want 0644", info.Mode().Perm())
	}
	checkMount(t, dir, Payload{"foo": file("v2", 0o600)})
}

func TestTeardown(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	if _, err := w.Write(Payload{"foo": file("foo", 0o644), "dir/bar": file("bar", 0o644)}); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..2026_01_02_03_04_05.000000001", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := w.Teardown(); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 0 {
		t.Errorf("after teardown the mount holds %v", names(entries))
	}
}

// FuzzWrite writes payloads with fuzzed paths and proves that nothing is
// ever created outside the mount directory and that accepted paths are
// readable inside it.
func FuzzWrite(f *testing.F) {
	for _, seed := range [][2]string{{"a", "b/c"}, {"../x", "y"}, {"/abs", "ok"}, {"..data", "x"}, {"a/../../b", "c//d"}, {"./..data_tmp", "e"}, {"a\x00b", "f"}} {
		f.Add(seed[0], seed[1])
	}
	base := f.TempDir()
	f.Fuzz(func(t *testing.T, p1, p2 string) {
		work, err := os.MkdirTemp(base, "case")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(work)
		dir := filepath.Join(work, "mount")
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(t, dir), DirUID: -1, DirGID: -1})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		payload := Payload{p1: file("one", 0o644), p2: file("two", 0o644)}
		_, werr := w.Write(payload)
		outside, err := os.ReadDir(work)
		if err != nil {
			t.Fatal(err)
		}
		if len(outside) != 2 || outside[0].Name() != "mount" || outside[1].Name() != "mount.manifests" {
			t.Fatalf("Write(%q, %q) created %v beside the mount", p1, p2, names(outside))
		}
		shared, err := os.ReadDir(base)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range shared {
			if !strings.HasPrefix(e.Name(), "case") {
				t.Fatalf("Write(%q, %q) created %s in the shared base", p1, p2, e.Name())
			}
		}
		inside, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if werr != nil {
			if len(inside) != 0 {
				t.Fatalf("failed Write(%q, %q) = %v left %v in the mount", p1, p2, werr, names(inside))
			}
			return
		}
		visible := map[string]bool{}
		for _, p := range []string{p1, p2} {
			clean, err := CleanPath(p)
			if err != nil {
				t.Fatalf("Write accepted %q, which CleanPath rejects: %v", p, err)
			}
			visible[strings.SplitN(clean, "/", 2)[0]] = true
			if _, err := os.ReadFile(filepath.Join(dir, clean)); err != nil {
				t.Fatalf("accepted path %q not readable: %v", p, err)
			}
		}
		for _, e := range inside {
			if name := e.Name(); name != DataDirName && !isVersionName(name) && !visible[name] {
				t.Fatalf("Write(%q, %q) made %s in the mount, not a name of its payload", p1, p2, name)
			}
		}
	})
}

// TestCheckRefusesAVersion runs a check against each new version: a
// refusal keeps the current version and leaves nothing behind.
func TestCheckRefusesAVersion(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	var checked []string
	w.SetCheck(func(c Candidate) error {
		versionDir := c.Path()
		checked = append(checked, versionDir)
		data, err := os.ReadFile(filepath.Join(versionDir, "app.conf"))
		if err != nil {
			return err
		}
		if strings.Contains(string(data), "broken") {
			return errors.New("syntax error in app.conf")
		}
		return nil
	}, -1)
	good := Payload{"app.conf": file("good", 0o644)}
	if _, err := w.Write(good); err != nil {
		t.Fatal(err)
	}
	version := w.Version()
	_, err := w.Write(Payload{"app.conf": file("broken", 0o644)})
	if !errors.Is(err, ErrCheckFailed) || !strings.Contains(err.Error(), "syntax error in app.conf") {
		t.Fatalf("Write = %v; want ErrCheckFailed with the check's error", err)
	}
	if w.Version() != version {
		t.Errorf("version %s; want %s kept", w.Version(), version)
	}
	checkMount(t, dir, good)
	if len(checked) != 2 || filepath.Dir(checked[1]) != dir || !isVersionName(filepath.Base(checked[1])) {
		t.Errorf("checked %v; want two version directories of %s", checked, dir)
	}
	if _, err := w.Write(Payload{"app.conf": file("fixed", 0o644)}); err != nil {
		t.Fatal(err)
	}
	checkMount(t, dir, Payload{"app.conf": file("fixed", 0o644)})
}

// TestVisibleNamesNotKeptAtRest: once a write or an adoption has found
// the visible symlinks to be exactly the current version's first path
// elements, the writer keeps no set of them (at 1,000 mounts of 100 files
// such sets were 4 MB of heap), and it still removes a name that leaves.
func TestVisibleNamesNotKeptAtRest(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	atRest := func(when string) {
		t.Helper()
		if w.visible != nil || w.visibleOf == nil || w.visibleOf != w.current {
			t.Errorf("%s: the writer keeps a set of %d visible names; want none", when, len(w.visible))
		}
	}
	if _, err := w.Write(Payload{"a": file("a", 0o644), "d/x": file("x", 0o644)}); err != nil {
		t.Fatal(err)
	}
	atRest("after a write")
	want := Payload{"a": file("a2", 0o644), "b": file("b", 0o644)}
	if _, err := w.Write(want); err != nil {
		t.Fatal(err)
	}
	atRest("after a write that removed d")
	checkMount(t, dir, want)
	w2 := newWriter(t, dir)
	if _, err := w2.AdoptOwned(); err != nil {
		t.Fatal(err)
	}
	w = w2
	atRest("after adoption from the manifest")
}

// TestWriteReplacesALeftoverDataTmp: a ..data_tmp that a switch left (a
// crash between its symlink and the rename), or a directory of that name,
// found at the next switch, is removed then and the switch happens.
func TestWriteReplacesALeftoverDataTmp(t *testing.T) {
	for _, leftover := range []string{"symlink", "directory"} {
		t.Run(leftover, func(t *testing.T) {
			dir := t.TempDir()
			w := newWriter(t, dir)
			if _, err := w.Write(Payload{"a": {Data: []byte("1"), Mode: 0o644}}); err != nil {
				t.Fatal(err)
			}
			tmp := filepath.Join(dir, dataTmpName)
			var err error
			if leftover == "symlink" {
				err = os.Symlink(w.Version(), tmp)
			} else {
				err = os.Mkdir(tmp, 0o755)
			}
			if err != nil {
				t.Fatal(err)
			}
			payload := Payload{"a": {Data: []byte("2"), Mode: 0o644}}
			if _, err := w.Write(payload); err != nil {
				t.Fatalf("Write over a leftover %s: %v", leftover, err)
			}
			checkMount(t, dir, payload)
			if _, err := os.Lstat(tmp); !os.IsNotExist(err) {
				t.Errorf("%s after the switch: %v", dataTmpName, err)
			}
		})
	}
}
