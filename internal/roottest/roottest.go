// Package roottest is for tests that need root: mounting tmpfs, changing
// owners. The development machines and CI run as root.
package roottest

import (
	"bufio"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Require skips the test when not running as root — or fails it when
// CI=true, where the machine runs as root and a skip would hide the test.
func Require(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		tb.Fatal("this test needs root, and CI runs as root")
	}
	tb.Skip("this test needs root")
}

// MountsAt counts the mounts whose mount point is dir, from
// /proc/self/mountinfo.
func MountsAt(tb testing.TB, dir string) int {
	tb.Helper()
	n := 0
	for _, p := range mountPoints(tb) {
		if p == dir {
			n++
		}
	}
	return n
}

// UnmountAtEnd makes sure nothing stays mounted at dir when the test ends.
// A test that runs a daemon, which may mount dir again until it stops,
// calls UnmountUnder after stopping it instead.
func UnmountAtEnd(tb testing.TB, dir string) {
	tb.Cleanup(func() {
		for MountsAt(tb, dir) > 0 {
			if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
				tb.Errorf("unmount %s: %v", dir, err)
				return
			}
		}
	})
}

// UnmountUnder detaches every mount whose mount point is dir or below it,
// from /proc/self/mountinfo, the deepest first and each as often as it is
// stacked, so that the temporary directory holding them can be removed.
// Harnesses call it once the daemon they ran has stopped: called before,
// a daemon whose reconciler finds its tmpfs gone mounts it again.
func UnmountUnder(tb testing.TB, dir string) {
	tb.Helper()
	for range 100 {
		points := mountPointsUnder(tb, dir)
		if len(points) == 0 {
			return
		}
		// The longest path first: a mount inside another goes before it.
		slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
		if err := unix.Unmount(points[0], unix.MNT_DETACH); err != nil {
			tb.Errorf("unmount %s: %v", points[0], err)
			return
		}
	}
	tb.Errorf("mounts still below %s after 100 unmounts", dir)
}

// mountPointsUnder returns the mount points that are dir or below it,
// one per mount.
func mountPointsUnder(tb testing.TB, dir string) []string {
	tb.Helper()
	var points []string
	for _, p := range mountPoints(tb) {
		if p == dir || strings.HasPrefix(p, dir+"/") {
			points = append(points, p)
		}
	}
	return points
}

// mountPoints returns the mount point of every mount of
// /proc/self/mountinfo (its fifth field), one per mount. The kernel
// escapes a space, tab, newline and backslash of a mount point in octal;
// the temporary directories of tests have none.
func mountPoints(tb testing.TB) []string {
	tb.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 4 {
			points = append(points, fields[4])
		}
	}
	if err := sc.Err(); err != nil {
		tb.Fatal(err)
	}
	return points
}

// ACL entry tags (include/uapi/linux/posix_acl.h).
const (
	ACLUserObj  = 0x01
	ACLUser     = 0x02
	ACLGroupObj = 0x04
	ACLGroup    = 0x08
	ACLMask     = 0x10
	ACLOther    = 0x20
)

// ACLEntry is one entry of a POSIX ACL.
type ACLEntry struct {
	Tag, Perm uint16
	ID        uint32
}

// SetACL sets the POSIX ACL of path — the access ACL, or with dflt the
// default ACL of a directory — as setfacl(1) would, by writing its
// extended attribute (acl(5)), so that tests need no acl package.
func SetACL(tb testing.TB, path string, dflt bool, entries ...ACLEntry) {
	tb.Helper()
	if err := unix.Setxattr(path, ACLXattr(dflt), ACLValue(entries...), 0); err != nil {
		tb.Fatalf("set the ACL of %s: %v", path, err)
	}
}

// ACLXattr returns the name of the extended attribute that holds a
// file's access ACL, or with dflt a directory's default ACL (acl(5)).
func ACLXattr(dflt bool) string {
	if dflt {
		return "system.posix_acl_default"
	}
	return "system.posix_acl_access"
}

// ACLValue returns the value of an ACL's extended attribute (ACLXattr)
// that holds entries: a little-endian version 2, then each entry's tag,
// permission and ID (include/uapi/linux/posix_acl_xattr.h).
func ACLValue(entries ...ACLEntry) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 2)
	for _, e := range entries {
		b = binary.LittleEndian.AppendUint16(b, e.Tag)
		b = binary.LittleEndian.AppendUint16(b, e.Perm)
		b = binary.LittleEndian.AppendUint32(b, e.ID)
	}
	return b
}

// User is a throw-away unprivileged local user that a test creates to act
// as an attacker on the host (the threat model's local non-root user).
type User struct {
	Name     string
	UID, GID int
}

// NewUser creates a system user with its own group and no home, login or
// password (useradd(8)), and removes both when the test ends.
func NewUser(tb testing.TB) User {
	tb.Helper()
	Require(tb)
	var rnd [4]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		tb.Fatal(err)
	}
	name := fmt.Sprintf("kvmt%x", rnd)
	out, err := exec.Command("useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name).CombinedOutput()
	if err != nil {
		tb.Fatalf("useradd %s: %v: %s", name, err, out)
	}
	tb.Cleanup(func() {
		if out, err := exec.Command("userdel", name).CombinedOutput(); err != nil {
			tb.Errorf("userdel %s: %v: %s", name, err, out)
		}
	})
	u, err := user.Lookup(name)
	if err != nil {
		tb.Fatal(err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return User{Name: name, UID: uid, GID: gid}
}

// Command returns a command that runs as u, in no supplementary group.
func (u User) Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(u.UID), Gid: uint32(u.GID), Groups: []uint32{}}}
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/nonexistent"}
	return cmd
}

// Run runs a shell script as u and fails the test when it fails.
func (u User) Run(tb testing.TB, script string) string {
	tb.Helper()
	out, err := u.Command("sh", "-c", script).CombinedOutput()
	if err != nil {
		tb.Fatalf("as %s: %s: %v: %s", u.Name, script, err, out)
	}
	return string(out)
}

// Chown gives path to u.
func (u User) Chown(tb testing.TB, path string) {
	tb.Helper()
	if err := os.Lchown(path, u.UID, u.GID); err != nil {
		tb.Fatal(err)
	}
}

// TempDir returns t.TempDir() with it and its parent made 0755, so that an
// unprivileged User can reach what a test puts there (t.TempDir's are
// 0700). Both stay root's.
func TempDir(tb testing.TB) string {
	tb.Helper()
	dir := tb.TempDir()
	for _, d := range []string{filepath.Dir(dir), dir} {
		if err := os.Chmod(d, 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

// HelperEnv is the environment variable that tells a test binary run by
// User.Helper which helper to act as.
const HelperEnv = "KVMOUNT_TEST_HELPER"

// Helper returns a command that runs, as u, the running test binary itself
// with HelperEnv=name and env, and -test.run=^TestHelperProcess$: the
// package's TestHelperProcess (see RunHelper) then does what name says, as
// u, with real system calls — what no shell command can (an extended
// attribute, renameat2). The binary is copied where u can execute it, and
// removed when the test ends.
func (u User) Helper(tb testing.TB, name string, env ...string) *exec.Cmd {
	tb.Helper()
	data, err := os.ReadFile("/proc/self/exe")
	if err != nil {
		tb.Fatal(err)
	}
	bin := filepath.Join(TempDir(tb), "helper.test")
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		tb.Fatal(err)
	}
	cmd := u.Command(bin, "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Dir = "/"
	cmd.Env = append(cmd.Env, append([]string{HelperEnv + "=" + name}, env...)...)
	return cmd
}

// RunHelper is the body of a package's TestHelperProcess: outside a
// helper it returns at once; inside one it runs helpers[name] and exits 0,
// or prints the error and exits 1.
func RunHelper(helpers map[string]func() error) {
	name := os.Getenv(HelperEnv)
	if name == "" {
		return
	}
	h, ok := helpers[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "no helper %q\n", name)
		os.Exit(2)
	}
	if err := h(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// Tools makes sure the commands named by pkgs' keys are here, installing
// the Debian packages (pkgs' values) that provide the missing ones with
// apt-get, which waits for another test's apt-get to finish first. With
// CI=true a failure is fatal — a skip would hide the test — elsewhere it
// skips.
func Tools(tb testing.TB, pkgs map[string]string) {
	tb.Helper()
	var missing []string
	for cmd, pkg := range pkgs {
		if _, err := exec.LookPath(cmd); err != nil && !slices.Contains(missing, pkg) {
			missing = append(missing, pkg)
		}
	}
	if len(missing) == 0 {
		return
	}
	Require(tb)
	slices.Sort(missing)
	install := fmt.Sprintf("apt-get -o DPkg::Lock::Timeout=300 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq %s", strings.Join(missing, " "))
	out, err := exec.Command("sh", "-c", install).CombinedOutput()
	if err != nil {
		if os.Getenv("CI") == "true" {
			tb.Fatalf("installing %v: %v\n%s", missing, err, out)
		}
		tb.Skipf("installing %v: %v", missing, err)
	}
}

// PowerCutFS is an ext4 file system on a loop device, made for a test: one
// that can lose power (CutPower) and be mounted again.
type PowerCutFS struct {
	tb    testing.TB
	image string
	// Dir is where it is mounted.
	Dir string
}

// NewPowerCutFS makes an ext4 image of size (truncate(1)'s syntax, as
// "64M") in a temporary directory and mounts it at Dir through a loop
// device. It is unmounted when the test ends. It needs root, mkfs.ext4 and
// losetup (installed when missing, see Tools).
func NewPowerCutFS(tb testing.TB, size string) *PowerCutFS {
	tb.Helper()
	Require(tb)
	Tools(tb, map[string]string{"mkfs.ext4": "e2fsprogs", "losetup": "mount"})
	base := TempDir(tb)
	f := &PowerCutFS{tb: tb, image: filepath.Join(base, "ext4.img"), Dir: filepath.Join(base, "fs")}
	f.command("truncate", "-s", size, f.image)
	f.command("mkfs.ext4", "-q", "-F", f.image)
	if err := os.Mkdir(f.Dir, 0o755); err != nil {
		tb.Fatal(err)
	}
	UnmountAtEnd(tb, f.Dir)
	f.Mount()
	return f
}

// Mount mounts the file system at Dir; the kernel replays its journal
// first, as at a boot after a power cut.
func (f *PowerCutFS) Mount() {
	f.tb.Helper()
	f.command("mount", "-o", "loop", f.image, f.Dir)
	if err := os.Chmod(f.Dir, 0o755); err != nil {
		f.tb.Fatal(err)
	}
}

// Unmount unmounts it, trying again for 30 s while it is busy: a process
// killed a moment before may still hold a file of it open.
func (f *PowerCutFS) Unmount() {
	f.tb.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		err := unix.Unmount(f.Dir, 0)
		if err == nil {
			return
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			f.tb.Fatalf("unmount %s: %v", f.Dir, err)
		}
	}
}

// EXT4_IOC_SHUTDOWN (_IOR('X', 125, __u32), the number of
// XFS_IOC_GOINGDOWN) and its flag that shuts the file system down without
// committing its journal (linux/fs/ext4/ioctl.c).
const (
	ext4IOCShutdown     = 0x8004587d
	ext4GoingNoLogFlush = 2
)

// CutPower shuts the file system down without committing its journal:
// from then on every operation on it fails with EIO, and what no fsync
// made durable never reaches the image — what a power cut leaves. Unmount
// and Mount it again to go on. It may be called from any goroutine, and
// returns the ioctl's error.
func (f *PowerCutFS) CutPower() error {
	fd, err := unix.Open(f.Dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.IoctlSetPointerInt(fd, ext4IOCShutdown, ext4GoingNoLogFlush); err != nil {
		return fmt.Errorf("EXT4_IOC_SHUTDOWN %s: %w", f.Dir, err)
	}
	return nil
}

func (f *PowerCutFS) command(name string, args ...string) {
	f.tb.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		f.tb.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}
