package projector

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/roottest"
)

// versionDirs lists the version directories in dir.
func versionDirs(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if isVersionName(e.Name()) {
			out = append(out, e.Name())
		}
	}
	return out
}

// TestNeverSwitchesToAVanishedVersion: a second writer's Adopt removes the
// new version as a leftover before the switch (two kvmounts on one state
// directory did this). Write must fail, and every file must stay.
func TestNeverSwitchesToAVanishedVersion(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	good := Payload{"app.conf": file("good", 0o644), "d/x": file("x", 0o600)}
	if _, err := w.Write(good); err != nil {
		t.Fatal(err)
	}
	w.SetCheck(func(Candidate) error {
		other := newWriter(t, dir)
		_, err := other.Adopt()
		return err
	}, -1)
	_, err := w.Write(Payload{"app.conf": file("new", 0o644), "d/x": file("x", 0o600)})
	if !errors.Is(err, ErrVersionVanished) {
		t.Fatalf("Write = %v; want ErrVersionVanished", err)
	}
	checkMount(t, dir, good)
}

// TestVanishedDuringTheSwitchIsRolledBack: the new version removed between
// ..data_tmp and the rename; ..data is pointed back at the previous version.
func TestVanishedDuringTheSwitchIsRolledBack(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	good := Payload{"app.conf": file("good", 0o644)}
	if _, err := w.Write(good); err != nil {
		t.Fatal(err)
	}
	testHookBeforeRename = func(string) {
		testHookBeforeRename = nil
		target, _ := os.Readlink(filepath.Join(dir, dataTmpName))
		if err := os.RemoveAll(filepath.Join(dir, target)); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(func() { testHookBeforeRename = nil })
	if _, err := w.Write(Payload{"app.conf": file("new", 0o644)}); !errors.Is(err, ErrVersionVanished) {
		t.Fatalf("Write = %v; want ErrVersionVanished", err)
	}
	checkMount(t, dir, good)
	next := Payload{"app.conf": file("next", 0o644)}
	if _, err := w.Write(next); err != nil {
		t.Fatal(err)
	}
	checkMount(t, dir, next)
}

// TestFsyncErrorAfterSwitchKeepsTheVersion: an fsync error after the rename
// must not remove the version ..data now names.
func TestFsyncErrorAfterSwitchKeepsTheVersion(t *testing.T) {
	dir := t.TempDir()
	w := newWriter(t, dir)
	if _, err := w.Write(Payload{"a": file("1", 0o644)}); err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	syncFile = func(f *os.File) error {
		// The build syncs the manifest directory, the version directory
		// and the mount directory once each, together; the switch the
		// mount directory once more, after them.
		if calls.Add(1) == 4 {
			return syscall.EIO
		}
		return f.Sync()
	}
	t.Cleanup(func() { syncFile = (*os.File).Sync })
	next := Payload{"a": file("2", 0o644)}
	if _, err := w.Write(next); !errors.Is(err, syscall.EIO) {
		t.Fatalf("Write = %v; want the fsync error", err)
	}
	checkMount(t, dir, next)
	if got, _ := os.Readlink(filepath.Join(dir, DataDirName)); got != w.Version() {
		t.Errorf("..data -> %s; writer's version %s", got, w.Version())
	}
}

// graceWriter opens an atomic writer on a new temporary directory, whose
// replaced versions are kept for an hour, closed when the test ends.
func graceWriter(t *testing.T) (string, *AtomicWriter) {
	t.Helper()
	dir := t.TempDir()
	w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(t, dir), DirUID: -1, DirGID: -1, Grace: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return dir, w
}

// TestReplacedVersionsKeptForGrace: replaced versions stay for their grace
// period, are removed by Collect once it is over, and never number more
// than MaxRetired.
func TestReplacedVersionsKeptForGrace(t *testing.T) {
	dir, w := graceWriter(t)
	var names []string
	write := func(i int) {
		t.Helper()
		if _, err := w.Write(Payload{"a": file(fmt.Sprint(i), 0o644)}); err != nil {
			t.Fatal(err)
		}
		names = append(names, w.Version())
	}
	for i := range 3 {
		write(i)
	}
	if got, want := versionDirs(t, dir), slices.Sorted(slices.Values(names)); !slices.Equal(got, want) {
		t.Errorf("after 3 writes: versions %v; want all %v within the grace period", got, want)
	}
	due, err := w.Collect(time.Now())
	if err != nil || due.IsZero() || len(versionDirs(t, dir)) != 3 {
		t.Fatalf("Collect before the grace period = %v, %v, %d versions; want a due time and nothing removed", due, err, len(versionDirs(t, dir)))
	}
	if _, err := w.Collect(due); err != nil || len(versionDirs(t, dir)) != 2 {
		t.Fatalf("Collect at the first due time: %v, %d versions; want the oldest removed", err, len(versionDirs(t, dir)))
	}
	if due, err := w.Collect(time.Now().Add(2 * time.Hour)); err != nil || !due.IsZero() {
		t.Fatalf("Collect after every grace period = %v, %v; want nothing left to collect", due, err)
	}
	if got := versionDirs(t, dir); !slices.Equal(got, names[2:]) {
		t.Errorf("after Collect: versions %v; want %v", got, names[2:])
	}
	checkMount(t, dir, Payload{"a": file("2", 0o644)})
	if err := w.Verify(); err != nil {
		t.Errorf("Verify: %v", err)
	}
	for i := range MaxRetired + 5 {
		write(10 + i)
	}
	if n := len(versionDirs(t, dir)); n != MaxRetired+1 {
		t.Errorf("after %d back-to-back writes: %d versions; want %d", MaxRetired+5, n, MaxRetired+1)
	}
	if err := w.Verify(); err != nil {
		t.Errorf("Verify with replaced versions present: %v", err)
	}
	// A restart (Adopt) keeps only the current version.
	w2 := newWriter(t, dir)
	if _, err := w2.Adopt(); err != nil {
		t.Fatal(err)
	}
	if n := len(versionDirs(t, dir)); n != 1 {
		t.Errorf("after Adopt: %d versions; want 1", n)
	}
}

// TestReplacedVersionsMakeRoom: on a tmpfs with room for three versions,
// replacing every file again and again never fails for want of space — the
// replaced versions kept for readers give way.
func TestReplacedVersionsMakeRoom(t *testing.T) {
	roottest.Require(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	roottest.UnmountAtEnd(t, dir)
	const limit = 64 << 10
	md, err := (Medium{Dir: dir, Tmpfs: true, SizeLimit: limit, Mode: 0o755, UID: -1, GID: -1}).Prepare(Owner{}, "", func(bool) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	defer md.File.Close()
	w, err := OpenAtomicWriterAt(dir, md.File, WriterOptions{ManifestDir: manifestDir(t, dir), DirUID: -1, DirGID: -1, Grace: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for i := range 20 {
		p := Payload{}
		for j := range 16 {
			p[fmt.Sprintf("f%d", j)] = File{Data: bytes.Repeat([]byte{byte(i)}, 4096), Mode: 0o644, UID: os.Geteuid(), GID: os.Getegid()}
		}
		if _, err := w.Write(p); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
}

// TestVisibleReadersNeverSeeENOENT reads visible names in two goroutines
// while a writer with the default grace (keep_replaced = 5 s) replaces
// every file back to back: not one read may fail. With the previous
// version removed right after the switch (Grace 0, the kubelet's order)
// this failed about once in 6,600 reads (BenchmarkReplacedGrace measures
// both).
func TestVisibleReadersNeverSeeENOENT(t *testing.T) {
	dir := t.TempDir()
	w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(t, dir), DirUID: -1, DirGID: -1, Grace: DefaultGrace})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	names := []string{"a.conf", "nested/b.conf", "c.conf"}
	write := func(n int) {
		p := Payload{}
		for _, name := range names {
			p[name] = file(fmt.Sprintf("%s %d", name, n), 0o644)
		}
		if _, err := w.Write(p); err != nil {
			t.Error(err)
		}
	}
	write(0)
	const perReader = 100_000
	var failures, reads atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(60 * time.Second)
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < perReader && time.Now().Before(deadline); i++ {
				if _, err := os.ReadFile(filepath.Join(dir, names[(i+r)%len(names)])); err != nil {
					if failures.Add(1) <= 5 {
						t.Errorf("read: %v", err)
					}
				}
				reads.Add(1)
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	writes := 0
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
			writes++
			write(writes)
		}
	}
	t.Logf("%d visible-name reads during %d writes, %d failed", reads.Load(), writes, failures.Load())
	if reads.Load() < 2*perReader {
		t.Errorf("%d reads; want %d", reads.Load(), 2*perReader)
	}
	if writes < 100 {
		t.Errorf("only %d writes: the readers did not race a writer", writes)
	}
}

// TestAdoptOwnedRemovesStrays: entries the writer did not make are removed
// by AdoptOwned (a planted symlink itself, never what it points at); the
// writer's own stay, and the version is adopted from its manifest.
func TestAdoptOwnedRemovesStrays(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	outside := filepath.Join(base, "outside")
	for _, d := range []string{dir, outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(outside, "keep"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	w := newWriter(t, dir)
	want := Payload{"app.conf": file("a", 0o644), "d/x": file("x", 0o644)}
	if _, err := w.Write(want); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"stray.txt", "..hidden"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "straydir"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "planted")); err != nil {
		t.Fatal(err)
	}
	if err := w.Verify(); !errors.Is(err, ErrDrift) {
		t.Fatalf("Verify = %v; want ErrDrift", err)
	}
	ad, err := w.AdoptOwned()
	if err != nil {
		t.Fatalf("AdoptOwned: %v", err)
	}
	if want := []string{"..hidden", "planted", "stray.txt", "straydir"}; !slices.Equal(ad.Removed, want) {
		t.Errorf("removed %v; want %v", ad.Removed, want)
	}
	if ad.Version == "" || !ad.FromManifest {
		t.Errorf("AdoptOwned = %+v; want the version adopted from its manifest", ad)
	}
	checkMount(t, dir, want)
	if _, err := os.Stat(filepath.Join(outside, "keep")); err != nil {
		t.Errorf("a file behind the planted symlink: %v", err)
	}
}

// TestDirectoryModesFollowOptions: a writer opened with a new directory
// mode or owner rebuilds the version so that every directory has them,
// even when the payload is unchanged.
func TestDirectoryModesFollowOptions(t *testing.T) {
	dir := t.TempDir()
	payload := Payload{"a": file("a", 0o644), "d/e/f": file("f", 0o644)}
	for _, tc := range []struct {
		mode     fs.FileMode
		uid, gid int
	}{{0o755, -1, -1}, {0o700, 4321, 8765}, {0o750, 4321, 8765}} {
		w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(t, dir), DirMode: tc.mode, DirUID: tc.uid, DirGID: tc.gid})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Adopt(); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(payload); err != nil {
			t.Fatal(err)
		}
		w.Close()
		version, _ := os.Readlink(filepath.Join(dir, DataDirName))
		for _, d := range []string{version, version + "/d", version + "/d/e"} {
			info, err := os.Lstat(filepath.Join(dir, d))
			if err != nil {
				t.Fatal(err)
			}
			st := info.Sys().(*syscall.Stat_t)
			if info.Mode().Perm() != tc.mode || tc.uid >= 0 && (int(st.Uid) != tc.uid || int(st.Gid) != tc.gid) {
				t.Errorf("%s: mode %v owner %d:%d; want %v %d:%d", d, info.Mode().Perm(), st.Uid, st.Gid, tc.mode, tc.uid, tc.gid)
			}
		}
		checkMount(t, dir, payload)
	}
}

// TestSymlinkedMountDirIsRefused: a mount directory that is a symlink is
// never opened through it.
func TestSymlinkedMountDirIsRefused(t *testing.T) {
	base := t.TempDir()
	target := filepath.Join(base, "target")
	if err := os.Mkdir(target, 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(base, "mnt")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenAtomicWriter(link, WriterOptions{DirUID: -1, DirGID: -1}); !errors.Is(err, fsutil.ErrNotDir) {
		t.Errorf("OpenAtomicWriter(symlink) = %v; want fsutil.ErrNotDir", err)
	}
}

// TestListReadsRelativeToTheDirectory: the listing adoption relies on
// gives each entry's type and each symlink's target without leaving a
// handle open, and reads them in the directory the writer holds even
// after its path was moved away and replaced.
func TestListReadsRelativeToTheDirectory(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	w := newWriter(t, dir)
	if _, err := w.Write(Payload{"a": file("a", 0o644), "d/x": file("x", 0o644)}); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc", filepath.Join(dir, "planted")); err != nil {
		t.Fatal(err)
	}
	// The writer's directory moves; another takes its path.
	if err := os.Rename(dir, filepath.Join(base, "moved")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	fds := func() int {
		entries, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(entries)
	}
	before := fds()
	var got []mountEntry
	for range 50 {
		var err error
		if got, err = w.list(); err != nil {
			t.Fatal(err)
		}
	}
	if after := fds(); after > before {
		t.Errorf("50 listings left %d handles open", after-before)
	}
	var summary []string
	for _, e := range got {
		switch {
		case isVersionName(e.name):
			summary = append(summary, fmt.Sprintf("version dir=%v", e.typ.IsDir()))
		default:
			summary = append(summary, fmt.Sprintf("%s visible=%v writers=%v target=%s", e.name, e.isVisibleLink(), e.isWriters(), strings.TrimPrefix(e.target, "..2")))
		}
	}
	want := []string{
		"version dir=true",
		"..data visible=false writers=true target=" + strings.TrimPrefix(mustReadlink(t, filepath.Join(base, "moved", DataDirName)), "..2"),
		"a visible=true writers=true target=..data/a",
		"d visible=true writers=true target=..data/d",
		"planted visible=false writers=false target=/etc",
	}
	if !slices.Equal(summary, want) {
		t.Errorf("list found\n%s\nwant\n%s", strings.Join(summary, "\n"), strings.Join(want, "\n"))
	}
}

func mustReadlink(t *testing.T, name string) string {
	t.Helper()
	target, err := os.Readlink(name)
	if err != nil {
		t.Fatal(err)
	}
	return target
}

// TestForgedVersionNamesAreNotAdopted is part of the second review's
// eleventh finding: the mount's user renamed the version directory to
// "..<stamp>.1<ESC>]0;pwned<BEL><CR><LF>other current ..." and pointed
// ..data at it; kvmount adopted it, and kvmount status printed the name
// raw. Only names of exactly kvmount's form are versions now: such a
// directory is foreign, removed as a stray from a mount kvmount owns, and
// the next write puts a version of its own in place.
func TestForgedVersionNamesAreNotAdopted(t *testing.T) {
	forged := "..2026_11_22_01_02_03.1\x1b]0;pwned\a\r\nother current"
	for _, name := range []string{forged, "..2026_11_22_01_02_03.12345678", "..2026_11_22_01_02_03.1234567890", "..2026_11_22_01_02_03.12345678x"} {
		if isVersionName(name) {
			t.Errorf("isVersionName(%q) = true", name)
		}
	}
	if !isVersionName("..2026_11_22_01_02_03.123456789") {
		t.Error("kvmount's own form is not a version name")
	}
	dir := t.TempDir()
	w := newWriter(t, dir)
	payload := Payload{"a": file("1", 0o644)}
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, w.Version()), filepath.Join(dir, forged)); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, DataDirName)); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(forged, filepath.Join(dir, DataDirName)); err != nil {
		t.Fatal(err)
	}
	w = newWriter(t, dir)
	ad, err := w.AdoptOwned()
	if err != nil {
		t.Fatal(err)
	}
	if ad.Version != "" || !slices.Contains(ad.Removed, forged) {
		t.Errorf("AdoptOwned = %+v; want no version adopted, the forged directory removed", ad)
	}
	if _, err := w.Write(payload); err != nil {
		t.Fatal(err)
	}
	checkMount(t, dir, payload)
}

// TestCandidateIsRootsUntilChecked: while a check runs as another user than
// the one who owns the mount's directories, the candidate's directories
// are kvmount's and writable by it alone; once the check has passed they
// have their configured owner and mode. A check that runs as that owner
// sees them as theirs from the start.
func TestCandidateIsRootsUntilChecked(t *testing.T) {
	roottest.Require(t)
	for _, tc := range []struct {
		name     string
		checkUID int
		mode     fs.FileMode
		during   string
	}{
		{"another user checks", 0, 0o755, fmt.Sprintf("%d:8765 755", os.Geteuid())},
		{"the owner checks", 4321, 0o755, "4321:8765 755"},
		{"the owner checks, the group may write", 4321, 0o775, fmt.Sprintf("%d:8765 755", os.Geteuid())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(t, dir), DirMode: tc.mode, DirUID: 4321, DirGID: 8765})
			if err != nil {
				t.Fatal(err)
			}
			defer w.Close()
			var seen []string
			w.SetCheck(func(c Candidate) error {
				for _, d := range []string{c.Path(), filepath.Join(c.Path(), "sub")} {
					info, err := os.Lstat(d)
					if err != nil {
						return err
					}
					st := info.Sys().(*syscall.Stat_t)
					seen = append(seen, fmt.Sprintf("%d:%d %o", st.Uid, st.Gid, info.Mode().Perm()))
				}
				return nil
			}, tc.checkUID)
			payload := Payload{"sub/a": File{Data: []byte("1"), Mode: 0o644, UID: 4321, GID: 8765}}
			if _, err := w.Write(payload); err != nil {
				t.Fatal(err)
			}
			for _, got := range seen {
				if got != tc.during {
					t.Errorf("during the check a directory was %s; want %s", got, tc.during)
				}
			}
			for _, d := range []string{w.Version(), filepath.Join(w.Version(), "sub")} {
				info, _ := os.Lstat(filepath.Join(dir, d))
				st := info.Sys().(*syscall.Stat_t)
				if st.Uid != 4321 || st.Gid != 8765 || info.Mode().Perm() != tc.mode {
					t.Errorf("after the check %s is %d:%d %o; want 4321:8765 %o", d, st.Uid, st.Gid, info.Mode().Perm(), tc.mode)
				}
			}
		})
	}
}

// TestCollectedVersionReleased: a replaced version removed by Collect is
// gone from memory too — its payload's bytes are collected once nothing
// else holds them, not kept alive by the writer until its next write.
func TestCollectedVersionReleased(t *testing.T) {
	_, w := graceWriter(t)
	first := make([]byte, 1<<16)
	released := make(chan struct{})
	runtime.AddCleanup(&first[0], func(ch chan struct{}) { close(ch) }, released)
	if _, err := w.Write(Payload{"a": {Data: first, Mode: 0o644}}); err != nil {
		t.Fatal(err)
	}
	first = nil
	if _, err := w.Write(Payload{"a": file("2", 0o644)}); err != nil {
		t.Fatal(err)
	}
	if due, err := w.Collect(time.Now().Add(2 * time.Hour)); err != nil || !due.IsZero() {
		t.Fatalf("Collect after the grace period = %v, %v; want every replaced version removed", due, err)
	}
	for range 50 {
		runtime.GC()
		select {
		case <-released:
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Error("the payload of a collected version is still held after 50 collections")
}

// TestVersionNamesAreOfTheirForm checks the names mkVersionDir makes:
// each of the form isVersionName adopts, of versionNameLen bytes, and
// their random suffixes not all the same (a stamp's spare capacity, which
// versionName appends into, must not carry one name into the next).
func TestVersionNamesAreOfTheirForm(t *testing.T) {
	stamp := time.Date(2026, 12, 4, 1, 2, 3, 0, time.UTC).AppendFormat(append(make([]byte, 0, versionNameLen), ".."...), versionTimeLayout)
	seen := map[string]bool{}
	for range 200 {
		name := versionName(stamp)
		if len(name) != versionNameLen || !isVersionName(name) || !strings.HasPrefix(name, "..2026_12_04_01_02_03.") {
			t.Fatalf("versionName = %q, not a version name of %d bytes of that stamp", name, versionNameLen)
		}
		seen[name] = true
	}
	if len(seen) < 190 {
		t.Errorf("200 names, %d different", len(seen))
	}
	if string(stamp) != "..2026_12_04_01_02_03" {
		t.Errorf("stamp changed to %q", stamp)
	}
}
