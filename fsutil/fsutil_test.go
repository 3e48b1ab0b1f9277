package fsutil

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

func TestDirExists(t *testing.T) {
	base := t.TempDir()
	file := filepath.Join(base, "file")
	link := filepath.Join(base, "link")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(base, link); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path    string
		want    bool
		wantErr error
	}{
		{base, true, nil},
		{filepath.Join(base, "missing"), false, nil},
		{file, false, ErrNotDir},
		{link, false, ErrNotDir},
	}
	for _, tt := range tests {
		got, err := DirExists(tt.path)
		if got != tt.want || !errors.Is(err, tt.wantErr) {
			t.Errorf("DirExists(%s) = %v, %v; want %v, %v", tt.path, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestMakeDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "b")
	uid, gid := -1, -1
	if os.Geteuid() == 0 {
		uid, gid = 4321, 8765
	}
	if err := MakeDir(dir, 0o755, uid, gid); err != nil {
		t.Fatal(err)
	}
	info, err := os.Stat(dir)
	if err != nil || !info.IsDir() {
		t.Fatalf("Stat = %v, %v", info, err)
	}
	st := info.Sys().(*syscall.Stat_t)
	if uid >= 0 && (int(st.Uid) != uid || int(st.Gid) != gid) {
		t.Errorf("owner %d:%d; want %d:%d", st.Uid, st.Gid, uid, gid)
	}
	parent, _ := os.Stat(filepath.Dir(dir))
	if pst := parent.Sys().(*syscall.Stat_t); uid >= 0 && int(pst.Uid) == uid {
		t.Errorf("the parent got the mount's owner too")
	}
	if err := MakeDir(dir, 0o755, -1, -1); err != nil {
		t.Errorf("MakeDir on an existing directory: %v", err)
	}
}

// TestMakeDirModes: parents get 0755 and the mount directory its own mode,
// whatever the umask.
func TestMakeDirModes(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	base := t.TempDir()
	dir := filepath.Join(base, "p", "q", "mnt")
	if err := MakeDir(dir, 0o750, -1, -1); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]os.FileMode{filepath.Join(base, "p"): 0o755, filepath.Join(base, "p", "q"): 0o755, dir: 0o750} {
		info, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if info.Mode().Perm() != want {
			t.Errorf("%s: mode %v; want %v", p, info.Mode().Perm(), want)
		}
	}
}

// TestSetDirAttrs: what differs is changed; what matches is left alone,
// the inode's ctime included.
func TestSetDirAttrs(t *testing.T) {
	roottest.Require(t) // chown
	dir := filepath.Join(t.TempDir(), "d")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil { // past the umask
		t.Fatal(err)
	}
	ctime := func() unix.Timespec {
		var st unix.Stat_t
		if err := unix.Stat(dir, &st); err != nil {
			t.Fatal(err)
		}
		return st.Ctim
	}
	set := func(mode os.FileMode, uid, gid int) {
		t.Helper()
		d, err := os.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		if err := SetDirAttrs(d, mode, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	before := ctime()
	time.Sleep(20 * time.Millisecond)
	set(0o755, -1, -1)
	set(0o755, 0, 0)
	if after := ctime(); after != before {
		t.Errorf("attributes that already matched were set again (ctime %v → %v)", before, after)
	}
	set(0o750, 1234, 4321)
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	if os.FileMode(st.Mode).Perm() != 0o750 || st.Uid != 1234 || st.Gid != 4321 {
		t.Errorf("mode %o, owner %d:%d; want 750, 1234:4321", os.FileMode(st.Mode).Perm(), st.Uid, st.Gid)
	}
	if ctime() == before {
		t.Error("ctime unchanged after a change of mode and owner")
	}
}
