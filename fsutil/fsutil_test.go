package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
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
	d, created, err := MakeDir(dir, 0o755, uid, gid)
	if err != nil || !created {
		t.Fatalf("MakeDir = %v, %v; want created", created, err)
	}
	d.Close()
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
	if d, created, err := MakeDir(dir, 0o755, -1, -1); err != nil || created {
		t.Errorf("MakeDir on an existing directory = %v, %v; want not created", created, err)
	} else {
		d.Close()
	}
}

// TestMakeDirModes: parents get 0755 and the mount directory its own mode,
// whatever the umask.
func TestMakeDirModes(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	base := t.TempDir()
	dir := filepath.Join(base, "p", "q", "mnt")
	d, _, err := MakeDir(dir, 0o750, -1, -1)
	if err != nil {
		t.Fatal(err)
	}
	d.Close()
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

// TestOpenNoFollowRefusesSymlinksInAnyComponent: a symlink anywhere in the
// path — the last component or any parent — is refused and named, by
// openat2 and by the component-wise walk alike.
func TestOpenNoFollowRefusesSymlinksInAnyComponent(t *testing.T) {
	base := t.TempDir()
	real := filepath.Join(base, "real")
	if err := os.MkdirAll(filepath.Join(real, "etc", "certs"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(real, filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("etc", filepath.Join(real, "etclink")); err != nil {
		t.Fatal(err)
	}
	for _, openat2 := range []bool{true, false} {
		t.Run(fmt.Sprintf("openat2=%v", openat2), func(t *testing.T) {
			defer noOpenat2.Store(noOpenat2.Load())
			noOpenat2.Store(!openat2)
			d, err := OpenDir(filepath.Join(real, "etc", "certs"))
			if err != nil {
				t.Fatalf("OpenDir(real path) = %v", err)
			}
			d.Close()
			for _, tt := range []struct{ path, link string }{
				{filepath.Join(base, "link", "etc", "certs"), filepath.Join(base, "link")},
				{filepath.Join(real, "etclink", "certs"), filepath.Join(real, "etclink")},
				{filepath.Join(real, "etclink"), filepath.Join(real, "etclink")},
			} {
				_, err := OpenDir(tt.path)
				if !errors.Is(err, ErrSymlink) || !strings.Contains(err.Error(), tt.link+" is a symlink") && !strings.Contains(err.Error(), "it is a symlink") {
					t.Errorf("OpenDir(%s) = %v; want ErrSymlink naming %s", tt.path, err, tt.link)
				}
			}
			if _, err := OpenDir(filepath.Join(real, "missing", "x")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("OpenDir(missing) = %v; want fs.ErrNotExist", err)
			}
		})
	}
}

// TestIdentity: a directory's identity follows the directory, not its path.
func TestIdentity(t *testing.T) {
	base := t.TempDir()
	a := filepath.Join(base, "a")
	if err := os.Mkdir(a, 0o755); err != nil {
		t.Fatal(err)
	}
	da, _ := OpenDir(a)
	defer da.Close()
	ia, err := IdentOf(da)
	if err != nil || ia.Ino == 0 || ia.FS == 0 {
		t.Fatalf("IdentOf = %v, %v", ia, err)
	}
	if err := CheckIdent(da, a, &ia); err != nil {
		t.Errorf("CheckIdent(same) = %v", err)
	}
	if err := CheckIdent(da, a, nil); err != nil {
		t.Errorf("CheckIdent(nothing recorded) = %v", err)
	}
	if err := os.Rename(a, a+".old"); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(a, 0o755); err != nil {
		t.Fatal(err)
	}
	db, _ := OpenDir(a)
	defer db.Close()
	if err := CheckIdent(db, a, &ia); !errors.Is(err, ErrReplaced) {
		t.Errorf("CheckIdent(a new directory at the path) = %v; want ErrReplaced", err)
	}
}

// TestMakeDirLeavesNoInheritedACL: a parent's default ACL does not reach the
// directories MakeDir creates.
func TestMakeDirLeavesNoInheritedACL(t *testing.T) {
	roottest.Require(t)
	base := t.TempDir()
	roottest.SetACL(t, base, true,
		roottest.ACLEntry{Tag: roottest.ACLUserObj, Perm: 7}, roottest.ACLEntry{Tag: roottest.ACLUser, Perm: 7, ID: 4242},
		roottest.ACLEntry{Tag: roottest.ACLGroupObj, Perm: 5}, roottest.ACLEntry{Tag: roottest.ACLMask, Perm: 7},
		roottest.ACLEntry{Tag: roottest.ACLOther, Perm: 0})
	d, _, err := MakeDir(filepath.Join(base, "p", "mnt"), 0o750, -1, -1)
	if err != nil {
		t.Fatal(err)
	}
	d.Close()
	for _, p := range []string{filepath.Join(base, "p"), filepath.Join(base, "p", "mnt")} {
		for _, name := range []string{ACLAccessXattr, ACLDefaultXattr} {
			if n, err := unix.Getxattr(p, name, make([]byte, 256)); err == nil {
				t.Errorf("%s has %s (%d bytes) after MakeDir", p, name, n)
			}
		}
	}
}

// TestExposures names the directories in which someone other than root can
// replace the next component, as sshd's StrictModes does — checked with a
// real unprivileged user's directory.
func TestExposures(t *testing.T) {
	u := roottest.NewUser(t)
	base := roottest.TempDir(t) // root-owned, below a sticky /tmp
	srv := filepath.Join(base, "srv")
	app := filepath.Join(srv, "app")
	if err := os.MkdirAll(filepath.Join(app, "etc", "certs"), 0o755); err != nil {
		t.Fatal(err)
	}
	check := func(path string, want ...string) {
		t.Helper()
		got, err := Exposures(path)
		if err != nil {
			t.Fatalf("Exposures(%s) = %v", path, err)
		}
		var dirs []string
		for _, e := range got {
			dirs = append(dirs, e.Dir)
		}
		if fmt.Sprint(dirs) != fmt.Sprint(want) {
			t.Errorf("Exposures(%s) = %v; want directories %v", path, got, want)
		}
	}
	mount := filepath.Join(app, "etc", "certs")
	check(mount)
	u.Chown(t, app)
	check(mount, app)
	if got, _ := Exposures(mount); len(got) == 1 && !strings.Contains(got[0].String(), u.Name) {
		t.Errorf("exposure %q does not name the owner %s", got[0], u.Name)
	}
	// What was named is real: the user swaps the path's next component.
	u.Run(t, "cd "+app+" && mv etc etc.old && mkdir etc && test ! -e etc/certs && rmdir etc && mv etc.old etc")
	if err := os.Lchown(app, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(srv, 0o777); err != nil {
		t.Fatal(err)
	}
	check(mount, srv)
	if err := unix.Chmod(srv, 0o1777); err != nil { // sticky, and app is root's
		t.Fatal(err)
	}
	check(mount)
	check(filepath.Join(srv, "new", "mnt"), srv) // anyone can create "new" first
	if err := unix.Chmod(srv, 0o755); err != nil {
		t.Fatal(err)
	}
	roottest.SetACL(t, srv, false,
		roottest.ACLEntry{Tag: roottest.ACLUserObj, Perm: 7}, roottest.ACLEntry{Tag: roottest.ACLUser, Perm: 7, ID: uint32(u.UID)},
		roottest.ACLEntry{Tag: roottest.ACLGroupObj, Perm: 5}, roottest.ACLEntry{Tag: roottest.ACLMask, Perm: 7},
		roottest.ACLEntry{Tag: roottest.ACLOther, Perm: 5})
	check(mount, srv)
	if err := unix.Chmod(srv, 0o755); err != nil { // sets the ACL's mask to r-x
		t.Fatal(err)
	}
	check(mount)
	if err := os.Symlink(app, filepath.Join(base, "applink")); err != nil {
		t.Fatal(err)
	}
	if _, err := Exposures(filepath.Join(base, "applink", "etc")); !errors.Is(err, ErrSymlink) {
		t.Errorf("Exposures(through a symlink) = %v; want ErrSymlink", err)
	}
}

// TestAuditorSharesDirectories checks that an Auditor, which inspects each
// directory once for many paths, finds what a walk of each path on its own
// finds: in a sticky directory whose entries belong to root, to a real
// unprivileged user, or do not exist yet, the verdict depends on the entry
// and not only on the directory.
func TestAuditorSharesDirectories(t *testing.T) {
	u := roottest.NewUser(t)
	base := roottest.TempDir(t)
	srv := filepath.Join(base, "srv")
	for _, d := range []string{"root/etc", "user/etc", "open/etc"} {
		if err := os.MkdirAll(filepath.Join(srv, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Chmod(srv, 0o1777); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, filepath.Join(srv, "user"))
	if err := unix.Chmod(filepath.Join(srv, "open"), 0o777); err != nil {
		t.Fatal(err)
	}
	paths := []string{
		filepath.Join(srv, "root", "etc"),
		filepath.Join(srv, "user", "etc"),
		filepath.Join(srv, "missing", "etc"),
		filepath.Join(srv, "open", "etc"),
		filepath.Join(srv, "root", "etc"),
	}
	want := []int{0, 2, 1, 1, 0} // exposures each path has on its own
	var a Auditor
	for i, p := range paths {
		alone, err := Exposures(p)
		if err != nil {
			t.Fatal(err)
		}
		shared, err := a.Exposures(p)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(shared) != fmt.Sprint(alone) || len(alone) != want[i] {
			t.Errorf("%s: Auditor found %v, a walk of its own %v; want %d exposures", p, shared, alone, want[i])
		}
	}
	// Inspected once each: srv's ancestors, srv, and the three entries of
	// srv that exist.
	if want := strings.Count(srv, "/") + 4; len(a.dirs) != want {
		t.Errorf("the Auditor inspected %d directories; want %d", len(a.dirs), want)
	}
}
