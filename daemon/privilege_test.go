package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

// TestHelperProcess is the body of roottest.User.Helper's commands.
func TestHelperProcess(t *testing.T) {
	roottest.RunHelper(map[string]func() error{
		// Swap $DIR/$A and $DIR/$B with renameat2(RENAME_EXCHANGE)
		// until $SECONDS have passed.
		"exchange": func() error {
			dir, err := os.Open(os.Getenv("DIR"))
			if err != nil {
				return err
			}
			seconds, _ := time.ParseDuration(os.Getenv("SECONDS") + "s")
			for end := time.Now().Add(seconds); time.Now().Before(end); {
				if err := unix.Renameat2(int(dir.Fd()), os.Getenv("A"), int(dir.Fd()), os.Getenv("B"), unix.RENAME_EXCHANGE); err != nil && err != unix.ENOENT {
					return err
				}
			}
			return nil
		},
	})
}

// sharedDir returns a directory every user may write (mode 1777), for
// commands that run as another user to leave a mark in.
func sharedDir(t *testing.T) string {
	t.Helper()
	d := filepath.Join(roottest.TempDir(t), "shared")
	if err := os.Mkdir(d, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(d, os.ModeSticky|0o777); err != nil {
		t.Fatal(err)
	}
	return d
}

// TestCommandsStartInRootWithLeastPrivilege is the second review's first
// finding: a store writer put json.py beside app.json, and a check that
// runs python3 -c "import json ..." imported it from its working
// directory — the mount — as root. Every command kvmount starts now begins
// in "/", a check runs as the mount's user or else nobody, a notify command
// as notify_user (the same default), and both in a clean environment.
func TestCommandsStartInRootWithLeastPrivilege(t *testing.T) {
	roottest.Tools(t, map[string]string{"/usr/bin/python3": "python3"})
	u := roottest.NewUser(t)
	marks := sharedDir(t)
	h := newHarness(t)
	pwned := filepath.Join(marks, "pwned")
	evil := fmt.Sprintf("import os\nopen(%q, 'w').write(str(os.getuid()))\ndef load(f):\n    return {}\n", pwned)
	h.put("/py/app.json", `{"a": 1}`, "/py/json.py", evil, "/who/a", "1", "/svc/a", "1")
	record := func(name string) string {
		return fmt.Sprintf(`["sh", "-c", "echo $(id -u):$(id -g):$(pwd):$HOME > %s/%s"]`, marks, name)
	}
	h.writeConfig(
		h.mount("py", "/py/", `check_command = ["/usr/bin/python3", "-c", "import json, sys; json.load(open(sys.argv[1]))", "{{dir}}/app.json"]`) +
			h.mount("who", "/who/", "check_command = "+record("check-nobody")) +
			fmt.Sprintf("  [[mount.notify]]\n  command = %s\n", record("notify-nobody")) +
			h.mount("svc", "/svc/", fmt.Sprintf("user = %q", u.Name), "check_command = "+record("check-user")) +
			fmt.Sprintf("  [[mount.notify]]\n  command = %s\n", record("notify-user")))
	h.start()
	h.waitContent(h.path("mnt", "py"), map[string]string{"app.json": `{"a": 1}`, "json.py": evil})
	h.waitContent(h.path("mnt", "who"), map[string]string{"a": "1"})
	h.waitContent(h.path("mnt", "svc"), map[string]string{"a": "1"})
	if got, err := os.ReadFile(pwned); err == nil {
		t.Errorf("the store's json.py ran, as uid %s", got)
	}
	nobody := fmt.Sprintf("%d:%d:/", 65534, 65534)
	user := fmt.Sprintf("%d:%d:/", u.UID, u.GID)
	for name, want := range map[string]string{"check-nobody": nobody, "check-user": user} {
		got, err := os.ReadFile(filepath.Join(marks, name))
		if err != nil || !strings.HasPrefix(string(got), want+":") {
			t.Errorf("%s: the command ran as uid:gid:cwd:HOME %q, %v; want %s:...", name, got, err, want)
		}
	}
	h.put("/who/a", "2", "/svc/a", "2")
	waitFileContentPrefix(t, filepath.Join(marks, "notify-nobody"), nobody+":")
	waitFileContentPrefix(t, filepath.Join(marks, "notify-user"), user+":")
}

// waitFileContentPrefix waits until path's content starts with prefix.
func waitFileContentPrefix(t *testing.T, path, prefix string) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		got, err := os.ReadFile(path)
		if err == nil && strings.HasPrefix(string(got), prefix) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s = %q, %v; want it to start with %q", path, got, err, prefix)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestCandidateHoldsVerifiedFilesOnly is the second review's second
// finding, played by a real unprivileged user who owns the mount: they
// replace a file of the live version with a symlink to a root-only file,
// then with a FIFO. The next version, checked by root (check_user =
// "root"), holds a regular file written anew instead of either: the check
// never reads the root-only file nor waits on the FIFO, nothing of the
// file reaches the log or status, and a failing check's output never
// reaches systemd's STATUS= line (every user's to read).
func TestCandidateHoldsVerifiedFilesOnly(t *testing.T) {
	u := roottest.NewUser(t)
	secretDir := t.TempDir() // 0700, root's
	secret := filepath.Join(secretDir, "root-only")
	if err := os.WriteFile(secret, []byte("ROOT-ONLY-SECRET"), 0o600); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t)
	h.put("/svc/app.conf", "listen 80", "/svc/n", "0")
	h.writeConfig(h.mount("svc", "/svc/", fmt.Sprintf("user = %q", u.Name), `check_user = "root"`, `check_timeout = "25s"`,
		`check_command = ["sh", "-c", "cat {{dir}}/app.conf {{dir}}/n; case $(cat {{dir}}/n) in fail) echo CHECK-OUTPUT-LINE; exit 1;; esac"]`))
	h.start()
	dir := h.path("mnt", "svc")
	h.waitContent(dir, map[string]string{"app.conf": "listen 80", "n": "0"})

	u.Run(t, fmt.Sprintf("cd %s/..data && ln -s %s .x && mv -f .x app.conf", dir, secret))
	h.put("/svc/n", "1")
	h.waitContent(dir, map[string]string{"app.conf": "listen 80", "n": "1"})
	u.Run(t, fmt.Sprintf("cd %s/..data && mkfifo .f && mv -f .f app.conf", dir))
	h.put("/svc/n", "2")
	h.waitContent(dir, map[string]string{"app.conf": "listen 80", "n": "2"})
	var st syscall.Stat_t
	if err := syscall.Lstat(filepath.Join(dir, "..data", "app.conf"), &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		t.Errorf("app.conf of the new version is not a regular file: mode %o, %v", st.Mode, err)
	}
	if strings.Contains(h.logs.String(), "ROOT-ONLY") {
		t.Error("the root-only file reached the log")
	}

	h.put("/svc/n", "fail")
	h.waitLog("operation failed", "mount=svc", "CHECK-OUTPUT-LINE")
	// The next pass reports the failure to systemd, then to /status
	// (observers in that order): once /status has it, STATUS= has had it.
	h.waitAdmin(h.statusSocket(), "/status", "CHECK-OUTPUT-LINE")
	h.statusMu.Lock()
	defer h.statusMu.Unlock()
	seen := false
	for _, line := range h.statusLines {
		if strings.Contains(line, "CHECK-OUTPUT-LINE") || strings.Contains(line, "ROOT-ONLY") {
			t.Errorf("STATUS= carries a check's output: %q", line)
		}
		seen = seen || strings.Contains(line, "check_command sh: exit status 1")
	}
	if !seen {
		t.Errorf("no STATUS= line names the failed check: %q", h.statusLines)
	}
}

// TestEditInPlaceIsRepaired is the second review's third finding: the
// mount's user rewrites a file in place (same size, same inode); the
// resync reads the bytes, and the repair rewrites them — the manifest,
// which still matches by size, mode, owner and inode, does not overrule
// them.
func TestEditInPlaceIsRepaired(t *testing.T) {
	u := roottest.NewUser(t)
	h := newHarness(t)
	h.put("/m/a", "GOODGOOD")
	h.writeConfig(h.mount("m", "/m/", fmt.Sprintf("user = %q", u.Name)))
	h.start()
	dir := h.path("mnt", "m")
	h.waitContent(dir, map[string]string{"a": "GOODGOOD"})
	// Once verified (resync_interval is 1 s), so that the edit is drift of
	// content known by its bytes.
	time.Sleep(1500 * time.Millisecond)
	before := inodeOf(t, filepath.Join(dir, "..data", "a"))
	u.Run(t, fmt.Sprintf("printf EVILEVIL > %s/..data/a", dir))
	if got, _ := os.ReadFile(filepath.Join(dir, "a")); string(got) != "EVILEVIL" || inodeOf(t, filepath.Join(dir, "..data", "a")) != before {
		t.Fatalf("the edit in place did not take: %q", got)
	}
	h.waitContent(dir, map[string]string{"a": "GOODGOOD"})
	h.waitLog("repaired drift", "mount=m")
}

// inodeOf returns path's inode number.
func inodeOf(t *testing.T, path string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestFIFOSwapFreezesNothing is the second review's fourth finding: the
// mount's user swaps a file of the live version with a FIFO in a loop
// (renameat2 RENAME_EXCHANGE, as a real unprivileged process). kvmount's
// verification never blocks in an open: drift in another mount is still
// repaired meanwhile, and the daemon stops promptly.
func TestFIFOSwapFreezesNothing(t *testing.T) {
	u := roottest.NewUser(t)
	h := newHarness(t)
	h.put("/m/zz", "zz", "/o/a", "a")
	h.writeConfig(h.mount("m", "/m/", fmt.Sprintf("user = %q", u.Name)) + h.mount("other", "/o/"))
	h.start()
	dir := h.path("mnt", "m")
	h.waitContent(dir, map[string]string{"zz": "zz"})
	h.waitContent(h.path("mnt", "other"), map[string]string{"a": "a"})
	version, _ := os.Readlink(filepath.Join(dir, "..data"))
	u.Run(t, fmt.Sprintf("mkfifo %s/%s/.fifo", dir, version))
	swapper := u.Helper(t, "exchange", "DIR="+filepath.Join(dir, version), "A=zz", "B=.fifo", "SECONDS=6")
	if err := swapper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = swapper.Process.Kill(); _ = swapper.Wait() })
	time.Sleep(2 * time.Second) // resyncs (every 1 s) meet the FIFO
	if err := os.Remove(filepath.Join(h.path("mnt", "other"), "..data", "a")); err != nil {
		t.Fatal(err)
	}
	h.waitContent(h.path("mnt", "other"), map[string]string{"a": "a"})
	stopped := make(chan struct{})
	go func() { h.stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the daemon did not stop within 10 s while a FIFO was swapped in")
	}
}

// TestRemovalTakesTheUsersRights is the second review's fifth finding: the
// mount's user moves into the mount a world-writable sticky directory
// (root's) holding a file of root's, which they could not delete. kvmount
// removes strays and leftovers with the user's rights: the file stays
// (reported), and the mount keeps updating.
func TestRemovalTakesTheUsersRights(t *testing.T) {
	u := roottest.NewUser(t)
	h := newHarness(t)
	h.put("/m/a", "1")
	h.writeConfig(h.mount("m", "/m/", fmt.Sprintf("user = %q", u.Name)))
	h.start()
	dir := h.path("mnt", "m")
	h.waitContent(dir, map[string]string{"a": "1"})
	theirs := filepath.Join(h.path(), "theirs")
	if err := os.Mkdir(theirs, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, theirs)
	for _, name := range []string{"stray", "..2020_01_01_00_00_00.000000001"} {
		shared := filepath.Join(theirs, name)
		if err := os.Mkdir(shared, 0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(shared, os.ModeSticky|0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(shared, "precious"), []byte("root's"), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := u.Command("rm", "-f", filepath.Join(shared, "precious")).CombinedOutput(); err == nil {
			t.Fatalf("the user could delete the file themselves: %s", out)
		}
		u.Run(t, fmt.Sprintf("mv %s %s/", shared, dir))
	}
	// Resyncs (every 1 s) find the strays; a restart adopts the mount.
	time.Sleep(2500 * time.Millisecond)
	h.stop()
	h.start()
	h.put("/m/a", "2")
	h.waitContent(dir, map[string]string{"a": "2"})
	for _, name := range []string{"stray", "..2020_01_01_00_00_00.000000001"} {
		if _, err := os.Stat(filepath.Join(dir, name, "precious")); err != nil {
			t.Errorf("kvmount deleted what the user could not: %s/precious: %v", name, err)
		}
	}
	h.waitLog("left entries kvmount did not write", "mount=m")
}
