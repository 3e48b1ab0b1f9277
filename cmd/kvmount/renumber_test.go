package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
)

// A renumbering file system: one the test mounts, unmounts and mounts
// again under another device number, as a reboot or remount does.
type renumberingFS struct {
	t    *testing.T
	kind string
	root string // the mount point
	// mount mounts the file system at root.
	mount func()
	// decoy takes a device number, so that the next mount gets another;
	// it returns what undoes it.
	decoy func() (release func())
}

// testCommand runs a command and fails the test when it fails.
func testCommand(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// devOf returns path's st_dev.
func devOf(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Dev
}

// inoOf returns path's inode number.
func inoOf(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// newRenumberingFS makes a file system of kind under base and mounts it:
// "bindfs" (FUSE, from Debian; options add bindfs options), "btrfs" and
// "ext4" (each on a loop device over an image file). Everything is
// unmounted and detached when the test ends.
func newRenumberingFS(t *testing.T, base, kind string, options ...string) *renumberingFS {
	t.Helper()
	f := &renumberingFS{t: t, kind: kind, root: filepath.Join(base, kind)}
	if err := os.Mkdir(f.root, 0o755); err != nil {
		t.Fatal(err)
	}
	roottest.UnmountAtEnd(t, f.root)
	tmpfsDecoy := func() func() {
		d, err := os.MkdirTemp(base, "decoy")
		if err != nil {
			t.Fatal(err)
		}
		testCommand(t, "mount", "-t", "tmpfs", "kvmount-test-decoy", d)
		roottest.UnmountAtEnd(t, d)
		return func() { testCommand(t, "umount", d) }
	}
	switch kind {
	case "bindfs":
		roottest.Tools(t, map[string]string{"bindfs": "bindfs"})
		under := filepath.Join(base, "under")
		if err := os.Mkdir(under, 0o755); err != nil {
			t.Fatal(err)
		}
		f.mount = func() { testCommand(t, "bindfs", append(options, under, f.root)...) }
		f.decoy = tmpfsDecoy
	case "btrfs", "ext4":
		roottest.Tools(t, map[string]string{"mkfs.btrfs": "btrfs-progs", "mkfs.ext4": "e2fsprogs", "losetup": "mount"})
		img := filepath.Join(base, kind+".img")
		size, mkfs := "64M", []string{"mkfs.ext4", "-q", "-F", img}
		if kind == "btrfs" {
			size, mkfs = "256M", []string{"mkfs.btrfs", "-q", "-f", img}
		}
		testCommand(t, "truncate", "-s", size, img)
		testCommand(t, mkfs[0], mkfs[1:]...)
		f.mount = func() { testCommand(t, "mount", "-o", "loop", img, f.root) }
		f.decoy = tmpfsDecoy
		if kind == "ext4" {
			// A loop device's number: the decoy takes the lowest free one.
			f.decoy = func() func() {
				decoyImg := filepath.Join(base, fmt.Sprintf("decoy-%d.img", time.Now().UnixNano()))
				testCommand(t, "truncate", "-s", "1M", decoyImg)
				dev := strings.TrimSpace(testCommand(t, "losetup", "--find", "--show", decoyImg))
				detach := func() { _ = exec.Command("losetup", "-d", dev).Run() }
				t.Cleanup(detach)
				return detach
			}
		}
	default:
		t.Fatalf("no file system %q", kind)
	}
	f.mount()
	return f
}

// remount unmounts the file system and mounts it again under another
// device number, taking the old one with decoys first; it fails the test
// when the number does not change.
func (f *renumberingFS) remount() {
	t := f.t
	t.Helper()
	before := devOf(t, f.root)
	testCommand(t, "umount", f.root)
	var releases []func()
	defer func() {
		for _, release := range releases {
			release()
		}
	}()
	for range 4 {
		releases = append(releases, f.decoy())
		f.mount()
		if devOf(t, f.root) != before {
			return
		}
		testCommand(t, "umount", f.root)
	}
	t.Fatalf("%s kept device number %d:%d over four remounts", f.kind, before>>8, before&0xff)
}

// waitStatus runs kvmount status until its output has want (or, with want
// "", until it exits 0) and returns that output.
func (e *env) waitStatus(want string, logs fmt.Stringer) string {
	e.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		code, out, errOut := runCmd("status", "-config", e.config)
		if want == "" && code == 0 || want != "" && strings.Contains(out, want) {
			return out
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("kvmount status never showed %q: exit %d\n%s%s\nlogs:\n%s", want, code, out, errOut, logs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop ends the daemon: SIGKILL when kill is set, else SIGTERM and a
// clean exit.
func stop(t *testing.T, cmd *exec.Cmd, kill bool, logs fmt.Stringer) {
	t.Helper()
	sig := syscall.SIGTERM
	if kill {
		sig = syscall.SIGKILL
	}
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil && !kill {
		t.Fatalf("exit %v; logs:\n%s", err, logs)
	}
}

// writeMountConfig writes a configuration with the one mount m at dir,
// following the prefix /m/.
func (e *env) writeMountConfig(dir string) {
	e.t.Helper()
	config := fmt.Sprintf("state_dir = %q\n[admin]\naddress = \"\"\nsocket = %q\n[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n[[mount]]\nname = \"m\"\ndir = %q\nsource = \"main\"\nprefix = \"/m/\"\n",
		filepath.Join(e.base, "state"), e.socket(), e.etcd.Endpoint(), dir)
	if err := os.WriteFile(e.config, []byte(config), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

// TestRenumberedFileSystems is issue 25's first finding, on the three
// file systems it names: a mount directory on FUSE (bindfs), btrfs and
// ext4 on a loop device, remounted under a new device number after a
// clean stop and after SIGKILL, is still kvmount's: the restarted daemon
// adopts it without rewriting a file, and the next write arrives. A
// directory that a real unprivileged user, owner of its parent, swaps in
// is still refused on each, and nothing is written into it.
func TestRenumberedFileSystems(t *testing.T) {
	roottest.Require(t)
	for _, kind := range []string{"bindfs", "btrfs", "ext4"} {
		for _, kill := range []bool{false, true} {
			name := kind + "/clean-stop"
			if kill {
				name = kind + "/sigkill"
			}
			t.Run(name, func(t *testing.T) {
				e := newEnv(t)
				u := roottest.NewUser(t)
				for _, d := range []string{filepath.Dir(e.base), e.base} {
					if err := os.Chmod(d, 0o755); err != nil { // for u to reach the parent
						t.Fatal(err)
					}
				}
				f := newRenumberingFS(t, e.base, kind)
				parent := filepath.Join(f.root, "parent")
				if err := os.Mkdir(parent, 0o755); err != nil {
					t.Fatal(err)
				}
				u.Chown(t, parent)
				dir := filepath.Join(parent, "m")
				e.writeMountConfig(dir)
				e.put("/m/a", "1")
				e.put("/m/b", "2")

				cmd, logs := e.start("run")
				waitFile(t, filepath.Join(dir, "a"), "1")
				waitFile(t, filepath.Join(dir, "b"), "2")
				version, err := os.Readlink(filepath.Join(dir, "..data"))
				if err != nil {
					t.Fatal(err)
				}
				inoA := inoOf(t, filepath.Join(dir, version, "a"))
				stop(t, cmd, kill, logs)

				f.remount()
				cmd, logs = e.start("run")
				e.waitStatus("", logs)
				if now, _ := os.Readlink(filepath.Join(dir, "..data")); now != version {
					t.Errorf("the restart rewrote the mount: ..data names %s, was %s; logs:\n%s", now, version, logs)
				}
				e.put("/m/b", "3")
				waitFile(t, filepath.Join(dir, "b"), "3")
				if ino := inoOf(t, filepath.Join(dir, "..data", "a")); ino != inoA {
					t.Errorf("the unchanged file a was rewritten (inode %d, was %d)", ino, inoA)
				}
				stop(t, cmd, false, logs)

				// The user who owns the parent swaps in a directory of
				// their own while kvmount is stopped.
				u.Run(t, fmt.Sprintf("mv %s %s.away && mkdir %s", dir, dir, dir))
				cmd, logs = e.start("run")
				out := e.waitStatus("reaches another directory", logs)
				if !strings.Contains(out, "kvmount adopt -mount m") {
					t.Errorf("kvmount status does not say how to take the directory over:\n%s", out)
				}
				e.put("/m/b", "4")
				time.Sleep(300 * time.Millisecond)
				if entries, err := os.ReadDir(dir); err != nil || len(entries) != 0 {
					t.Errorf("kvmount wrote into the user's directory: %v, %v", entries, err)
				}
				if got, _ := os.ReadFile(filepath.Join(dir+".away", "b")); string(got) != "3" {
					t.Errorf("the moved-away mount holds b = %q; want 3", got)
				}
				stop(t, cmd, false, logs)
			})
		}
	}
}

// TestAdoptWhereNoMarkerIsKept: on a file system that keeps no trusted
// attribute (bindfs --xattr-none), a remount that renumbers it leaves
// kvmount unable to tell its directory from a swapped one: it refuses the
// directory, says so in kvmount status (with the command that takes it
// over) and in the metric, and kvmount adopt — against the running daemon,
// then with none running — takes it over, after which writes arrive.
func TestAdoptWhereNoMarkerIsKept(t *testing.T) {
	roottest.Require(t)
	e := newEnv(t)
	f := newRenumberingFS(t, e.base, "bindfs", "--xattr-none")
	// Every user may write the file system's root, the mount's parent:
	// someone else could have put a directory at its path.
	if err := os.Chmod(filepath.Join(e.base, "under"), 0o777); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(f.root, "m")
	e.writeMountConfig(dir)
	e.put("/m/a", "1")
	cmd, logs := e.start("run")
	waitFile(t, filepath.Join(dir, "a"), "1")
	stop(t, cmd, false, logs)

	f.remount()
	cmd, logs = e.start("run")
	out := e.waitStatus("cannot tell", logs)
	if !strings.Contains(out, "kvmount adopt -mount m") {
		t.Errorf("kvmount status does not say how to take the directory over:\n%s", out)
	}
	if metrics := privateGet(t, e.socket(), "/metrics"); !strings.Contains(metrics, `guard="mount_dir_unrecognized"`) {
		t.Errorf("no mount_dir_unrecognized in the metrics:\n%s", metrics)
	}
	code, stdout, stderr := runCmd("adopt", "-config", e.config, "-mount", "m")
	if code != 0 || !strings.Contains(stdout, "current") {
		t.Fatalf("kvmount adopt = %d\n%s%s\nlogs:\n%s", code, stdout, stderr, logs)
	}
	e.put("/m/a", "2")
	waitFile(t, filepath.Join(dir, "a"), "2")
	stop(t, cmd, false, logs)

	// With no daemon running, adopt records it for the next start.
	f.remount()
	code, stdout, stderr = runCmd("adopt", "-config", e.config, "-mount", "m")
	if code != 0 || !strings.Contains(stdout, "next start") {
		t.Fatalf("kvmount adopt without a daemon = %d\n%s%s", code, stdout, stderr)
	}
	if code, _, stderr := runCmd("adopt", "-config", e.config, "-mount", "nosuch"); code == 0 || !strings.Contains(stderr, "no such mount") {
		t.Errorf("kvmount adopt of an unknown mount = %d, %s", code, stderr)
	}
	cmd, logs = e.start("run")
	e.waitStatus("", logs)
	e.put("/m/a", "3")
	waitFile(t, filepath.Join(dir, "a"), "3")
	stop(t, cmd, false, logs)
}

// privateGet GETs path from the private admin socket and returns the body.
func privateGet(t *testing.T, socket, path string) string {
	t.Helper()
	body, err := privateFetch(socket, path)
	if err != nil {
		t.Fatal(err)
	}
	return body
}

// privateFetch is privateGet returning its error, for a caller that tries
// again.
func privateFetch(socket, path string) (string, error) {
	client, done := privateClient(socket)
	defer done()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://kvmount"+path, nil)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return string(body), err
}

// TestReadoptWhereOnlyRootCould: the same file system without markers,
// renumbered, where the mount directory and every ancestor are root's
// and no one else can write them: nobody but root could have put another
// directory there, so kvmount takes it back by itself — logged, not
// refused — and writes arrive, after a clean stop and after SIGKILL.
func TestReadoptWhereOnlyRootCould(t *testing.T) {
	roottest.Require(t)
	e := newEnv(t)
	f := newRenumberingFS(t, e.base, "bindfs", "--xattr-none")
	dir := filepath.Join(f.root, "m")
	e.writeMountConfig(dir)
	e.put("/m/a", "1")
	cmd, logs := e.start("run")
	waitFile(t, filepath.Join(dir, "a"), "1")
	for i, kill := range []bool{false, true} {
		stop(t, cmd, kill, logs)
		f.remount()
		cmd, logs = e.start("run")
		e.waitStatus("", logs)
		v := strconv.Itoa(i + 2)
		e.put("/m/a", v)
		waitFile(t, filepath.Join(dir, "a"), v)
		if logs.Count("mount directory taken back", "mount=m") != 1 || logs.Count("cannot tell") != 0 {
			t.Errorf("after remount %d: not taken back by itself, or refused:\n%s", i+1, logs)
		}
	}
	stop(t, cmd, false, logs)
}
