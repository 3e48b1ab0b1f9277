package fsutil

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

func TestTmpfsMountRemountUnmount(t *testing.T) {
	roottest.Require(t)
	dir := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	if ok, err := IsTmpfsMount(dir); ok || err != nil {
		t.Fatalf("IsTmpfsMount(plain dir) = %v, %v", ok, err)
	}
	if err := MountTmpfs(dir, TmpfsOptions{Size: 1 << 20, Mode: 0o750, UID: 1234, GID: 5678}); err != nil {
		t.Fatal(err)
	}
	if ok, err := IsTmpfsMount(dir); !ok || err != nil {
		t.Fatalf("IsTmpfsMount(tmpfs) = %v, %v", ok, err)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		t.Fatal(err)
	}
	if size := int64(sfs.Blocks) * sfs.Bsize; size != 1<<20 {
		t.Errorf("tmpfs size %d; want %d", size, 1<<20)
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
	if err := os.WriteFile(filepath.Join(dir, "kept"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Mounting again remounts: no stacked mount, content kept, new size.
	if err := MountTmpfs(dir, TmpfsOptions{Size: 2 << 20, Mode: 0o755, UID: -1, GID: -1}); err != nil {
		t.Fatal(err)
	}
	if n := roottest.MountsAt(t, dir); n != 1 {
		t.Errorf("%d mounts at %s; want 1", n, dir)
	}
	if _, err := os.Stat(filepath.Join(dir, "kept")); err != nil {
		t.Errorf("remount lost the content: %v", err)
	}
	_ = unix.Statfs(dir, &sfs)
	if size := int64(sfs.Blocks) * sfs.Bsize; size != 2<<20 {
		t.Errorf("after remount, size %d; want %d", size, 2<<20)
	}
	if err := UnmountTmpfs(dir); err != nil {
		t.Fatal(err)
	}
	if ok, _ := IsTmpfsMount(dir); ok || roottest.MountsAt(t, dir) != 0 {
		t.Errorf("still mounted after UnmountTmpfs")
	}
	if _, err := os.Stat(filepath.Join(dir, "kept")); !os.IsNotExist(err) {
		t.Errorf("the tmpfs content is still visible: %v", err)
	}
	if err := UnmountTmpfs(dir); err != nil {
		t.Errorf("UnmountTmpfs on a plain directory = %v; want nil", err)
	}
}

// TestDirectoryOnTmpfsIsNotATmpfsMount: a plain directory inside a tmpfs
// (as any under /run) is not a mount of its own.
func TestDirectoryOnTmpfsIsNotATmpfsMount(t *testing.T) {
	roottest.Require(t)
	base := filepath.Join(t.TempDir(), "mnt")
	if err := os.Mkdir(base, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(base, unix.MNT_DETACH) })
	if err := MountTmpfs(base, TmpfsOptions{Size: 1 << 20, Mode: 0o755, UID: -1, GID: -1}); err != nil {
		t.Fatal(err)
	}
	inner := filepath.Join(base, "inner")
	if err := os.Mkdir(inner, 0o755); err != nil {
		t.Fatal(err)
	}
	if ok, err := IsTmpfsMount(inner); ok || err != nil {
		t.Errorf("IsTmpfsMount(dir on a tmpfs) = %v, %v; want false", ok, err)
	}
	if err := UnmountTmpfs(base); err != nil {
		t.Fatal(err)
	}
}
