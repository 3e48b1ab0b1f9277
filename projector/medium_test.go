package projector

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/roottest"
)

func noRecord(bool) error { return nil }

// TestPrepareRefusesAReplacedDirectory: a mount directory whose path now
// reaches another directory than the one recorded — its parent's owner
// renamed it away and made a new one — is refused and left as it is, on
// disk and on tmpfs; a missing one is created anew.
func TestPrepareRefusesAReplacedDirectory(t *testing.T) {
	roottest.Require(t)
	for _, tmpfs := range []bool{false, true} {
		t.Run(fmt.Sprintf("tmpfs=%v", tmpfs), func(t *testing.T) {
			app := filepath.Join(t.TempDir(), "app")
			dir := filepath.Join(app, "certs")
			roottest.UnmountAtEnd(t, dir)
			roottest.UnmountAtEnd(t, filepath.Join(app+".old", "certs"))
			m := Medium{Dir: dir, Tmpfs: tmpfs, SizeLimit: 1 << 20, Mode: 0o750, UID: -1, GID: -1}
			const token = "0123456789abcdef0123456789abcdef"
			md, err := m.Prepare(Owner{}, token, noRecord)
			if err != nil {
				t.Fatal(err)
			}
			// The directory written into (the tmpfs's root on tmpfs)
			// carries the marker, and so does the directory below.
			if got, err := fsutil.ReadMarker(md.File); got != token || err != nil {
				t.Errorf("the marker of the directory written into = %q, %v; want %q", got, err, token)
			}
			md.File.Close()
			if !md.Created || md.Owner.Dir == nil || (md.Owner.Tmpfs != nil) != tmpfs || md.Owner.Marker != token {
				t.Fatalf("Prepare = created %v, owner %+v", md.Created, md.Owner)
			}
			owner := md.Owner
			// A restart finds the same directory: accepted.
			md, err = m.Prepare(owner, owner.Marker, noRecord)
			if err != nil {
				t.Fatalf("Prepare(same directory) = %v", err)
			}
			md.File.Close()
			if tmpfs && *md.Owner.Tmpfs != *owner.Tmpfs {
				t.Errorf("the tmpfs's identity changed on a remount: %v → %v", *owner.Tmpfs, *md.Owner.Tmpfs)
			}
			// The owner of app swaps the path's last parent.
			if err := os.Rename(app, app+".old"); err != nil {
				t.Fatal(err)
			}
			if err := os.MkdirAll(dir, 0o777); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(dir, 0o777); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "theirs"), nil, 0o666); err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(filepath.Join(dir, "theirs")); err != nil {
				t.Fatal(err)
			}
			_, err = m.Prepare(owner, owner.Marker, noRecord)
			if !errors.Is(err, fsutil.ErrReplaced) {
				t.Fatalf("Prepare(replaced directory) = %v; want fsutil.ErrReplaced", err)
			}
			if roottest.MountsAt(t, dir) != 0 {
				t.Error("a tmpfs was mounted on the replacement")
			}
			if info, _ := os.Stat(dir); info.Mode().Perm() != 0o777 {
				t.Errorf("the replacement's mode changed to %v", info.Mode().Perm())
			}
			if _, err := m.Open(owner); !errors.Is(err, fsutil.ErrReplaced) {
				t.Errorf("Open(replaced directory) = %v; want fsutil.ErrReplaced", err)
			}
			if err := m.Release(owner, true); !errors.Is(err, fsutil.ErrReplaced) {
				t.Errorf("Release(replaced directory) = %v; want fsutil.ErrReplaced", err)
			}
			if _, err := os.Stat(dir); err != nil {
				t.Errorf("Release removed the replacement: %v", err)
			}
			// Gone altogether: created anew.
			if err := os.RemoveAll(app); err != nil {
				t.Fatal(err)
			}
			md, err = m.Prepare(owner, owner.Marker, noRecord)
			if err != nil || !md.Created {
				t.Fatalf("Prepare(missing directory) = %v; want it created", err)
			}
			md.File.Close()
			if err := m.Release(md.Owner, true); err != nil {
				t.Errorf("Release = %v", err)
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Errorf("Release left the directory it created: %v", err)
			}
		})
	}
}

// TestPrepareTakesOverADirectoryWithADefaultACL: a mount directory that
// someone else made, with a default ACL that would let them read what is
// written in it, is taken over — owner, mode, and no ACL — and nothing
// kvmount writes there inherits one.
func TestPrepareTakesOverADirectoryWithADefaultACL(t *testing.T) {
	u := roottest.NewUser(t)
	dir := filepath.Join(roottest.TempDir(t), "secrets")
	if err := os.Mkdir(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, dir)
	acl := []roottest.ACLEntry{{Tag: roottest.ACLUserObj, Perm: 7}, {Tag: roottest.ACLUser, Perm: 7, ID: uint32(u.UID)},
		{Tag: roottest.ACLGroupObj, Perm: 7}, {Tag: roottest.ACLMask, Perm: 7}, {Tag: roottest.ACLOther, Perm: 7}}
	roottest.SetACL(t, dir, true, acl...)
	roottest.SetACL(t, dir, false, acl...)
	md, err := (Medium{Dir: dir, Mode: 0o750, UID: 0, GID: 0}).Prepare(Owner{}, "", noRecord)
	if err != nil {
		t.Fatal(err)
	}
	defer md.File.Close()
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 || st.Mode&0o7777 != 0o750 {
		t.Errorf("mount directory owner %d mode %o; want 0, 750", st.Uid, st.Mode&0o7777)
	}
	w, err := OpenAtomicWriterAt(dir, md.File, WriterOptions{ManifestDir: manifestDir(t, dir), DirMode: 0o750, DirUID: 0, DirGID: 0})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.Write(Payload{"db/password": {Data: []byte("s3cret"), Mode: 0o440, UID: 0, GID: 0}}); err != nil {
		t.Fatal(err)
	}
	version, _ := os.Readlink(filepath.Join(dir, DataDirName))
	for _, p := range []string{dir, filepath.Join(dir, version), filepath.Join(dir, version, "db"), filepath.Join(dir, version, "db", "password")} {
		for _, name := range []string{fsutil.ACLAccessXattr, fsutil.ACLDefaultXattr} {
			if _, err := syscall.Getxattr(p, name, make([]byte, 256)); err == nil {
				t.Errorf("%s carries %s", p, name)
			}
		}
	}
	// The user who made the directory reads nothing.
	out, err := u.Command("cat", filepath.Join(dir, "db", "password")).CombinedOutput()
	if err == nil || strings.Contains(string(out), "s3cret") {
		t.Errorf("the directory's maker read the secret: %q, %v", out, err)
	}
}

// TestTmpfsAccountingCountsFilesAndDirectories: every file, an empty one
// too, and every directory take a page of size_limit.
func TestTmpfsAccountingCountsFilesAndDirectories(t *testing.T) {
	page := pageSize
	for _, tt := range []struct {
		payload Payload
		want    int64
	}{
		{Payload{}, 0},
		{Payload{"a": {}}, page},
		{Payload{"a": {Data: make([]byte, page+1)}}, 2 * page},
		{Payload{"d/a": {}, "d/e/b": {}}, 4 * page},
	} {
		if got := TmpfsBytes(tt.payload); got != tt.want {
			t.Errorf("TmpfsBytes(%d files) = %d; want %d", len(tt.payload), got, tt.want)
		}
	}
	empty := Payload{}
	for i := range 100_000 {
		empty[fmt.Sprintf("k%d", i)] = File{}
	}
	m := Medium{Tmpfs: true, SizeLimit: 64 << 10}
	if err := m.CheckFits(empty); err == nil {
		t.Error("100,000 empty files fit a 64 KiB tmpfs")
	}
	for _, tt := range []struct {
		limit int64
		files int
		want  int64
	}{
		{64 << 10, 10_000, 4*(16+1) + 16}, // 16 pages of files and directories per version
		{64 << 20, 100, 4*(200+1) + 16},   // 100 files and 100 directories per version
	} {
		if got := TmpfsInodes(tt.limit, tt.files); got != tt.want {
			t.Errorf("TmpfsInodes(%d, %d) = %d; want %d", tt.limit, tt.files, got, tt.want)
		}
	}
}

// TestFailedBuildLeavesNothing: a build that fails half way (here the
// tmpfs runs out of inodes) leaves no partial version directory.
func TestFailedBuildLeavesNothing(t *testing.T) {
	roottest.Require(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	roottest.UnmountAtEnd(t, dir)
	md, err := (Medium{Dir: dir, Tmpfs: true, SizeLimit: 16 << 10, MaxFiles: 4, Mode: 0o755, UID: -1, GID: -1}).Prepare(Owner{}, "", noRecord)
	if err != nil {
		t.Fatal(err)
	}
	defer md.File.Close()
	w, err := OpenAtomicWriterAt(dir, md.File, WriterOptions{ManifestDir: manifestDir(t, dir), DirUID: -1, DirGID: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	p := Payload{}
	for i := range 200 {
		p[fmt.Sprintf("f%03d", i)] = file("x", 0o644)
	}
	if _, err := w.Write(p); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("Write(200 files into %d inodes) = %v; want ENOSPC", TmpfsInodes(16<<10, 4), err)
	}
	if got := versionDirs(t, dir); len(got) != 0 {
		t.Errorf("version directories after a failed first write: %v; want none", got)
	}
}
