package fsutil

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

// mkdir makes dir and returns it open.
func mkdir(t *testing.T, dir string) *os.File {
	t.Helper()
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	d, err := OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

func TestTmpfsMountRemountUnmount(t *testing.T) {
	roottest.Require(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	d := mkdir(t, dir)
	roottest.UnmountAtEnd(t, dir)
	if st, err := MountStateOf(dir); st != NotMounted || err != nil {
		t.Fatalf("MountStateOf(plain dir) = %v, %v", st, err)
	}
	root, err := MountTmpfs(d, TmpfsOptions{Size: 1 << 20, Inodes: 100, Mode: 0o750, UID: 1234, GID: 5678})
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	if st, err := MountStateOf(dir); st != OwnTmpfs || err != nil {
		t.Fatalf("MountStateOf(tmpfs) = %v, %v", st, err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	if size := int64(sfs.Blocks) * sfs.Bsize; size != 1<<20 {
		t.Errorf("tmpfs size %d; want %d", size, 1<<20)
	}
	if sfs.Files != 100 {
		t.Errorf("tmpfs inodes %d; want 100", sfs.Files)
	}
	if sfs.Flags&unix.ST_NOSUID == 0 || sfs.Flags&unix.ST_NODEV == 0 || sfs.Flags&unix.ST_NOEXEC == 0 {
		t.Errorf("mount flags %#x; want nosuid, nodev, noexec", sfs.Flags)
	}
	info, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	st := info.Sys().(*syscall.Stat_t)
	if info.Mode().Perm() != 0o750 || st.Uid != 1234 || st.Gid != 5678 {
		t.Errorf("root dir mode %v owner %d:%d; want 0750 1234:5678", info.Mode().Perm(), st.Uid, st.Gid)
	}
	if ident, _ := IdentOf(root); ident == (Ident{}) {
		t.Error("no identity for the tmpfs root")
	}
	if err := os.WriteFile(filepath.Join(dir, "kept"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Mounting again, on the directory as it is now, is refused; a
	// remount keeps the content.
	again, err := OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if _, err := MountTmpfs(again, TmpfsOptions{Size: 1 << 20, Mode: 0o755, UID: -1, GID: -1}); err == nil {
		t.Error("MountTmpfs on kvmount's tmpfs: want an error")
	}
	if err := RemountTmpfs(root, TmpfsOptions{Size: 2 << 20, Inodes: 200, Mode: 0o755, UID: -1, GID: -1}); err != nil {
		t.Fatal(err)
	}
	if n := roottest.MountsAt(t, dir); n != 1 {
		t.Errorf("%d mounts at %s; want 1", n, dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "kept")); err != nil {
		t.Errorf("remount lost the content: %v", err)
	}
	_ = unix.Statfs(dir, &sfs)
	if size := int64(sfs.Blocks) * sfs.Bsize; size != 2<<20 || sfs.Files != 200 {
		t.Errorf("after remount, size %d, inodes %d; want %d, 200", size, sfs.Files, 2<<20)
	}
	if err := UnmountTmpfs(root); err != nil {
		t.Fatal(err)
	}
	if st, _ := MountStateOf(dir); st != NotMounted || roottest.MountsAt(t, dir) != 0 {
		t.Errorf("still mounted after UnmountTmpfs")
	}
	if _, err := os.Stat(filepath.Join(dir, "kept")); !os.IsNotExist(err) {
		t.Errorf("the tmpfs content is still visible: %v", err)
	}
	if err := UnmountTmpfs(d); err != nil {
		t.Errorf("UnmountTmpfs on a plain directory = %v; want nil", err)
	}
}

// TestDirectoryOnTmpfsIsNotATmpfsMount: a plain directory inside a tmpfs
// (as any under /run) is not a mount of its own.
func TestDirectoryOnTmpfsIsNotATmpfsMount(t *testing.T) {
	roottest.Require(t)
	base := filepath.Join(t.TempDir(), "mnt")
	d := mkdir(t, base)
	roottest.UnmountAtEnd(t, base)
	root, err := MountTmpfs(d, TmpfsOptions{Size: 1 << 20, Mode: 0o755, UID: -1, GID: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	inner := filepath.Join(base, "inner")
	if err := os.Mkdir(inner, 0o755); err != nil {
		t.Fatal(err)
	}
	if st, err := MountStateOf(inner); st != NotMounted || err != nil {
		t.Errorf("MountStateOf(dir on a tmpfs) = %v, %v; want NotMounted", st, err)
	}
	if err := UnmountTmpfs(root); err != nil {
		t.Fatal(err)
	}
}

// TestForeignTmpfsIsLeftAlone: a tmpfs that kvmount did not mount is never
// remounted or unmounted — its size, options and files stay as they were.
func TestForeignTmpfsIsLeftAlone(t *testing.T) {
	roottest.Require(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	d := mkdir(t, dir)
	roottest.UnmountAtEnd(t, dir)
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m,mode=0711"); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "theirs"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if st, err := MountStateOf(dir); st != ForeignMount || err != nil {
		t.Fatalf("MountStateOf(foreign tmpfs) = %v, %v; want ForeignMount", st, err)
	}
	theirs, err := OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer theirs.Close()
	// The handle opened before the mount reaches the directory below it.
	if _, err := MountTmpfs(d, TmpfsOptions{Size: 4 << 20, Mode: 0o755, UID: -1, GID: -1}); err != nil {
		// Mounting on the covered directory would stack; refusing is fine too.
		t.Logf("MountTmpfs on the covered directory: %v", err)
	} else {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
	}
	if err := RemountTmpfs(theirs, TmpfsOptions{Size: 4 << 20, Mode: 0o755, UID: -1, GID: -1}); !errors.Is(err, ErrForeignMount) {
		t.Errorf("RemountTmpfs of a foreign tmpfs = %v; want ErrForeignMount", err)
	}
	if err := UnmountTmpfs(theirs); !errors.Is(err, ErrForeignMount) {
		t.Errorf("UnmountTmpfs of a foreign tmpfs = %v; want ErrForeignMount", err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	info, _ := os.Stat(dir)
	if size := int64(sfs.Blocks) * sfs.Bsize; size != 1<<20 || info.Mode().Perm() != 0o711 || roottest.MountsAt(t, dir) != 1 {
		t.Errorf("foreign tmpfs changed: size %d, mode %v, %d mounts; want 1 MiB, 0711, 1", size, info.Mode().Perm(), roottest.MountsAt(t, dir))
	}
	if _, err := os.Stat(filepath.Join(dir, "theirs")); err != nil {
		t.Errorf("foreign file: %v", err)
	}
}

// TestSymlinkedDirIsRefused: a mount directory replaced by a symlink is
// refused; nothing is created in or mounted on the directory it points at.
func TestSymlinkedDirIsRefused(t *testing.T) {
	roottest.Require(t)
	base := t.TempDir()
	target := filepath.Join(base, "target")
	link := filepath.Join(base, "mnt")
	if err := os.Mkdir(target, 0o700); err != nil {
		t.Fatal(err)
	}
	roottest.UnmountAtEnd(t, target)
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenDir(link); !errors.Is(err, ErrNotDir) || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("OpenDir(symlink) = %v; want ErrNotDir naming a symlink", err)
	}
	if _, err := MountStateOf(link); !errors.Is(err, ErrNotDir) {
		t.Errorf("MountStateOf(symlink) = %v; want ErrNotDir", err)
	}
	if _, _, err := MakeDir(link, 0o777, 1234, 1234); !errors.Is(err, ErrNotDir) {
		t.Errorf("MakeDir(symlink) = %v; want ErrNotDir", err)
	}
	if _, _, err := MakeDir(filepath.Join(link, "below"), 0o777, 1234, 1234); !errors.Is(err, ErrSymlink) {
		t.Errorf("MakeDir(below a symlink) = %v; want ErrSymlink", err)
	}
	if _, err := os.Stat(filepath.Join(target, "below")); !os.IsNotExist(err) {
		t.Errorf("MakeDir created a directory behind the symlink: %v", err)
	}
	if n := roottest.MountsAt(t, target); n != 0 {
		t.Errorf("%d mounts at the symlink's target", n)
	}
	info, _ := os.Stat(target)
	if info.Mode().Perm() != 0o700 {
		t.Errorf("target mode %v; want 0700", info.Mode().Perm())
	}
}

// TestTmpfsNoswap: kvmount's tmpfs is mounted noswap where the kernel has
// it (Linux ≥ 6.4), and a remount keeps it.
func TestTmpfsNoswap(t *testing.T) {
	roottest.Require(t)
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	var major, minor int
	fmt.Sscanf(unix.ByteSliceToString(uts.Release[:]), "%d.%d", &major, &minor)
	dir := filepath.Join(t.TempDir(), "mnt")
	d := mkdir(t, dir)
	roottest.UnmountAtEnd(t, dir)
	root, err := MountTmpfs(d, TmpfsOptions{Size: 1 << 20, Mode: 0o700, UID: -1, GID: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	for i := range 2 { // mount, then remount
		if i == 1 {
			if err := RemountTmpfs(root, TmpfsOptions{Size: 1 << 20, Mode: 0o700, UID: -1, GID: -1}); err != nil {
				t.Fatal(err)
			}
		}
		_, info, err := MountAt(root)
		if err != nil {
			t.Fatal(err)
		}
		want := major > 6 || major == 6 && minor >= 4
		if got := hasOption(info.VFSOptions, "noswap"); got != want {
			t.Errorf("kernel %d.%d: noswap %v (options %q); want %v", major, minor, got, info.VFSOptions, want)
		}
		if info.Source != TmpfsSource {
			t.Errorf("mount source %q; want %q", info.Source, TmpfsSource)
		}
	}
}
