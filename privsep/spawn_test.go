package privsep

import (
	"bufio"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/escapetest"
	"github.com/kvmount/kvmount/internal/roottest"
)

// TestHelperProcess is the worker of the tests, run by them as a real
// unprivileged user (roottest.User.Helper); outside them it does nothing.
func TestHelperProcess(t *testing.T) {
	roottest.RunHelper(map[string]func() error{"worker": testWorker, "sender": testSender, "reacher": testReacher, "echo": testEcho})
}

// workerReport is what the test worker prints: what Confine applied and,
// for each attempt, its error ("" for none).
type workerReport struct {
	Confinement Confinement
	Attempts    map[string]string
}

// testWorker confines itself when KVMOUNT_TEST_CONFINE is set (to the TCP
// port KVMOUNT_TEST_ALLOWED), prints "ready", waits for a line on stdin
// (the test reads its /proc/PID/status meanwhile), then tries what a
// compromised worker would, and prints a workerReport.
func testWorker() error {
	var report workerReport
	allowed, _ := strconv.Atoi(os.Getenv("KVMOUNT_TEST_ALLOWED"))
	if os.Getenv("KVMOUNT_TEST_CONFINE") != "" {
		c, err := Confine(Policy{ReadFiles: []string{"/etc/hosts"}, ConnectTCP: []uint16{uint16(allowed)}})
		if err != nil {
			return err
		}
		report.Confinement = c
	}
	fmt.Println("ready")
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return err
	}
	monitor, _ := strconv.Atoi(os.Getenv("KVMOUNT_TEST_MONITOR"))
	attempts := escapetest.Attempts(monitor, os.Getenv("KVMOUNT_TEST_OTHER_ADDR"))
	attempts["open /etc/passwd"] = func() error { return escapetest.CloseAfter(os.Open("/etc/passwd")) }
	attempts["read /etc/hosts"] = func() error { _, err := os.ReadFile("/etc/hosts"); return err }
	attempts["connect allowed"] = func() error {
		return escapetest.CloseAfter(net.Dial("tcp", os.Getenv("KVMOUNT_TEST_ALLOWED_ADDR")))
	}
	// Another process of the worker's user: prlimit(2) asks nothing
	// more to lower its open files to none. (Each trust domain's worker
	// is a user of its own, so this is the seccomp filter's own bound.)
	sibling, _ := strconv.Atoi(os.Getenv("KVMOUNT_TEST_SIBLING"))
	attempts["prlimit sibling"] = func() error {
		return unix.Prlimit(sibling, unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: 0, Max: 0}, nil)
	}
	attempts["prlimit self"] = func() error {
		var lim unix.Rlimit
		return unix.Prlimit(0, unix.RLIMIT_NOFILE, nil, &lim)
	}
	report.Attempts = escapetest.Run(attempts)
	return json.NewEncoder(os.Stdout).Encode(report)
}

// runWorker spawns the test worker as a new unprivileged user, confined
// or not, and returns its /proc/PID/status (read while it waits) and its
// report.
func runWorker(t *testing.T, confine bool) (map[string]string, workerReport) {
	t.Helper()
	u := roottest.NewUser(t)
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		return l
	}
	allowed, other := listen(), listen()
	// A process of the worker's user beside it.
	sibling := exec.Command("/bin/sleep", "60")
	sibling.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(u.UID), Gid: uint32(u.GID)}}
	if err := sibling.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sibling.Process.Kill()
		sibling.Wait()
	})
	env := []string{
		"KVMOUNT_TEST_SIBLING=" + strconv.Itoa(sibling.Process.Pid),
		"KVMOUNT_TEST_ALLOWED=" + strconv.Itoa(allowed.Addr().(*net.TCPAddr).Port),
		"KVMOUNT_TEST_ALLOWED_ADDR=" + allowed.Addr().String(),
		"KVMOUNT_TEST_OTHER_ADDR=" + other.Addr().String(),
		"KVMOUNT_TEST_MONITOR=" + strconv.Itoa(os.Getpid()),
	}
	if confine {
		env = append(env, "KVMOUNT_TEST_CONFINE=1")
	}
	cmd := u.Helper(t, "worker", env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	w, err := Spawn(cmd, Identity{UID: u.UID, GID: u.GID})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.Process.Kill()
		w.Wait()
	})
	out := bufio.NewReader(stdout)
	if line, err := out.ReadString('\n'); line != "ready\n" {
		w.Wait()
		t.Fatalf("the worker said %q, %v; stderr:\n%s", line, err, stderr.String())
	}
	status := procStatus(t, w.Process.Pid)
	if _, err := stdin.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	var report workerReport
	if err := json.NewDecoder(out).Decode(&report); err != nil {
		w.Wait()
		t.Fatalf("the worker's report: %v; stderr:\n%s", err, stderr.String())
	}
	if err := w.Wait(); err != nil {
		t.Fatalf("the worker: %v; stderr:\n%s", err, stderr.String())
	}
	return status, report
}

// procStatus returns the fields of /proc/PID/status.
func procStatus(t *testing.T, pid int) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		t.Fatal(err)
	}
	fields := map[string]string{}
	for line := range strings.SplitSeq(string(data), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			fields[k] = strings.TrimSpace(v)
		}
	}
	return fields
}

// TestSpawnedWorkerHoldsNoPrivilege: a worker started by Spawn runs as its
// user in no other group, every capability set empty, no_new_privs set —
// whatever Confine does after.
func TestSpawnedWorkerHoldsNoPrivilege(t *testing.T) {
	roottest.Require(t)
	before := procStatus(t, os.Getpid())
	status, _ := runWorker(t, false)
	for _, field := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
		if status[field] != "0000000000000000" {
			t.Errorf("%s: %s; want none", field, status[field])
		}
	}
	if uid := strings.Fields(status["Uid"]); len(uid) != 4 || slicesContain(uid, "0") {
		t.Errorf("Uid: %s; want no root id", status["Uid"])
	}
	if gid := strings.Fields(status["Gid"]); len(gid) != 4 || slicesContain(gid, "0") {
		t.Errorf("Gid: %s; want no root id", status["Gid"])
	}
	if status["Groups"] != "" {
		t.Errorf("Groups: %s; want none", status["Groups"])
	}
	if status["NoNewPrivs"] != "1" {
		t.Errorf("NoNewPrivs: %s", status["NoNewPrivs"])
	}
	// The monitor's own threads keep their privileges.
	after := procStatus(t, os.Getpid())
	for _, field := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "NoNewPrivs"} {
		if after[field] != before[field] {
			t.Errorf("the monitor's %s went from %s to %s", field, before[field], after[field])
		}
	}
}

func slicesContain(s []string, v string) bool {
	for _, e := range s {
		if e == v {
			return true
		}
	}
	return false
}

// TestConfinedWorker: the worker confined by Confine shows Seccomp 2 and
// fails at everything a compromised worker would try — reading
// /etc/shadow or any file outside its policy, writing under /root or
// anywhere, mounting, signalling PID 1, tracing the monitor, a
// user namespace, changing its ids, executing a program, connecting to a port not
// configured — while it still reads its policy's files and connects to
// its port. The same worker unconfined does what Landlock and seccomp
// alone refuse, so the test fails if they are not applied.
func TestConfinedWorker(t *testing.T) {
	roottest.Require(t)
	status, confined := runWorker(t, true)
	if status["Seccomp"] != "2" {
		t.Errorf("Seccomp: %s; want 2 (filter)", status["Seccomp"])
	}
	if !confined.Confinement.Seccomp || confined.Confinement.LandlockABI < 4 {
		// This machine's kernel has Landlock ABI 7 and seccomp.
		t.Errorf("confinement %+v; want seccomp and Landlock ABI 4 or later", confined.Confinement)
	}
	denied := maps.Clone(escapetest.Refusals)
	denied["open /etc/passwd"] = unix.EACCES // Landlock: outside the policy
	denied["prlimit sibling"] = unix.EPERM   // seccomp: prlimit64 on itself alone
	for name, want := range denied {
		got, ok := confined.Attempts[name]
		if !ok || got == "" || !strings.Contains(got, want.Error()) {
			t.Errorf("%s: %q; want it refused with %v", name, got, want)
		}
	}
	for _, name := range []string{"read /etc/hosts", "connect allowed", "prlimit self"} {
		if got := confined.Attempts[name]; got != "" {
			t.Errorf("%s: %s; the policy allows it", name, got)
		}
	}

	_, free := runWorker(t, false)
	for _, name := range []string{"open /etc/passwd", "write under /tmp", "setresuid", "execve", "connect other",
		"fork", "i386 fork", "memfd_create", "udp socket", "unix socket", "listen", "prlimit sibling"} {
		got, tried := free.Attempts[name]
		if !tried && name == "i386 fork" {
			continue // no i386 entry on this architecture
		}
		if got != "" {
			t.Errorf("unconfined, %s: %s; want it to succeed, so that the confined refusal is Confine's", name, got)
		}
	}
}

// TestSpawnRefusesRoot: a worker never runs as root.
func TestSpawnRefusesRoot(t *testing.T) {
	for _, id := range []Identity{{0, 1000}, {1000, 0}} {
		if _, err := Spawn(nil, id); err == nil {
			t.Errorf("Spawn as %+v: no error", id)
		}
	}
}

// TestFilterAssembles: the allowlist assembles for every kind of policy
// on this architecture (the library refuses a name the architecture does
// not have), and lists no system call twice.
func TestFilterAssembles(t *testing.T) {
	seen := map[string]bool{}
	for _, n := range workerSyscalls {
		if seen[n] {
			t.Errorf("%s listed twice", n)
		}
		seen[n] = true
	}
	for _, p := range []Policy{{}, {ConnectTCP: []uint16{2379}}, {ConnectTCP: []uint16{443}, SendUDP: []uint16{53}}, {UnixSockets: []string{"/run/etcd.sock"}}} {
		f, err := filterFor(p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Policy.Assemble(); err != nil {
			t.Errorf("%+v: %v", p, err)
		}
	}
}
