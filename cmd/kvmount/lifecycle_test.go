package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// notifySocket listens where a Type=notify service's NOTIFY_SOCKET points
// and records the datagrams sd_notify sends.
type notifySocket struct {
	path string

	mu      sync.Mutex
	history []string
	cursor  int // wait's position in history
}

func listenNotify(t *testing.T) *notifySocket {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	n := &notifySocket{path: path}
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := conn.Read(buf)
			if err != nil {
				return
			}
			n.mu.Lock()
			n.history = append(n.history, string(buf[:k]))
			n.mu.Unlock()
		}
	}()
	return n
}

// wait waits for a message holding want after the one the last wait
// matched: messages in order.
func (n *notifySocket) wait(t *testing.T, want string) {
	t.Helper()
	n.find(t, want, true)
}

// seen waits for a message holding want, at any position.
func (n *notifySocket) seen(t *testing.T, want string) {
	t.Helper()
	n.find(t, want, false)
}

func (n *notifySocket) find(t *testing.T, want string, ordered bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		n.mu.Lock()
		from := 0
		if ordered {
			from = n.cursor
		}
		for i := from; i < len(n.history); i++ {
			if strings.Contains(n.history[i], want) {
				if ordered {
					n.cursor = i + 1
				}
				n.mu.Unlock()
				return
			}
		}
		history := strings.Join(n.history, " | ")
		n.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("no %q on NOTIFY_SOCKET; got %s", want, history)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// childRunning reports whether parent has a child process whose command
// line is argv.
func childRunning(parent int, argv ...string) bool {
	procs, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, stat := range procs {
		data, err := os.ReadFile(stat)
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...
		fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
		if len(fields) < 2 || fields[1] != strconv.Itoa(parent) {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join(filepath.Dir(stat), "cmdline"))
		if string(cmdline) == strings.Join(argv, "\x00")+"\x00" {
			return true
		}
	}
	return false
}

// writeAppConfig writes a configuration with the admin endpoint at admin
// ("" for none) and one mount "app" of /app/, with extra lines in its table.
func (e *env) writeAppConfig(admin, extra string) {
	e.t.Helper()
	cfg := fmt.Sprintf(`state_dir = %q
[admin]
address = %q
socket = %q
[sources.main]
type = "etcd"
endpoints = [%q]
dial_timeout = "1s"
[[mount]]
name = "app"
dir = %q
source = "main"
prefix = "/app/"
%s
`, filepath.Join(e.base, "state"), admin, e.socket(), e.etcd.Endpoint(), e.dir("app"), extra)
	if err := os.WriteFile(e.config, []byte(cfg), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

// TestLifecycle runs the binary as systemd would: READY=1 once projected,
// RELOADING=1 and READY=1 around SIGHUP, STOPPING=1 as soon as SIGTERM
// arrives even while a check command holds a write; a second SIGTERM kills
// that command and the daemon exits 0 with the mount's last content.
func TestLifecycle(t *testing.T) {
	e := newEnv(t)
	notify := listenNotify(t)
	e.put("/app/a", "1")
	e.writeAppConfig("", `check_command = ["sh", "-c", "test ! -e {{dir}}/slow || exec sleep 60"]
check_timeout = "5m"`)
	cmd, logs := e.startEnv([]string{"NOTIFY_SOCKET=" + notify.path}, "run")
	notify.wait(t, "READY=1")
	waitFile(t, filepath.Join(e.dir("app"), "a"), "1")

	if err := cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	notify.wait(t, "RELOADING=1")
	notify.wait(t, "READY=1")

	e.put("/app/slow", "x")
	deadline := time.Now().Add(waitTimeout)
	for !childRunning(cmd.Process.Pid, "sleep", "60") {
		if time.Now().After(deadline) {
			t.Fatalf("the check command never started; logs:\n%s", logs)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	notify.wait(t, "STOPPING=1")
	if !childRunning(cmd.Process.Pid, "sleep", "60") {
		t.Fatalf("the write in progress ended before STOPPING=1 was checked; logs:\n%s", logs)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case err := <-exited:
		t.Fatalf("kvmount exited (%v) while a write was in progress; logs:\n%s", err, logs)
	case <-time.After(300 * time.Millisecond):
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Errorf("kvmount exited with %v after a second SIGTERM; logs:\n%s", err, logs)
		}
	case <-time.After(waitTimeout):
		t.Fatalf("kvmount still running after a second SIGTERM; logs:\n%s", logs)
	}
	if !strings.Contains(logs.String(), "stop forced") {
		t.Errorf("no forced stop in the logs:\n%s", logs)
	}
	waitFile(t, filepath.Join(e.dir("app"), "a"), "1")
	if _, err := os.Lstat(filepath.Join(e.dir("app"), "slow")); !os.IsNotExist(err) {
		t.Errorf("the version whose check was killed is visible: %v", err)
	}
	checkOneVersion(t, e.dir("app"))
}

// TestSIGTERMFinishesTheWriteInProgress: SIGTERM while a write waits for
// its check_command: the daemon waits for the command, switches to the new
// version and exits 0.
func TestSIGTERMFinishesTheWriteInProgress(t *testing.T) {
	e := newEnv(t)
	e.put("/app/a", "1")
	e.writeAppConfig("", `check_command = ["sh", "-c", "test ! -e {{dir}}/slow || exec sleep 1"]`)
	cmd, logs := e.start("run")
	waitFile(t, filepath.Join(e.dir("app"), "a"), "1")
	e.put("/app/slow", "x")
	deadline := time.Now().Add(waitTimeout)
	for !childRunning(cmd.Process.Pid, "sleep", "1") {
		if time.Now().After(deadline) {
			t.Fatalf("the check command never started; logs:\n%s", logs)
		}
		time.Sleep(time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit %v after SIGTERM; logs:\n%s", err, logs)
	}
	if data, err := os.ReadFile(filepath.Join(e.dir("app"), "slow")); err != nil || string(data) != "x" {
		t.Errorf("the write in progress at SIGTERM did not finish: slow = %q, %v; logs:\n%s", data, err, logs)
	}
	checkOneVersion(t, e.dir("app"))
}

// TestStatusCommandAndWatchdog runs the binary with an admin socket and
// systemd's watchdog enabled: WATCHDOG=1 and STATUS= arrive on the notify
// socket; kvmount status exits 0 while every mount is current, 1 while
// one is stale, 2 once the daemon is gone.
func TestStatusCommandAndWatchdog(t *testing.T) {
	e := newEnv(t)
	notify := listenNotify(t)
	socket := filepath.Join(e.base, "admin.sock")
	e.put("/app/a", "1")
	e.writeAppConfig("unix:"+socket, "")
	cmd, logs := e.startEnv([]string{"NOTIFY_SOCKET=" + notify.path, "WATCHDOG_USEC=200000"}, "run")
	notify.wait(t, "READY=1")
	notify.seen(t, "STATUS=1 mount: 1 current")
	notify.wait(t, "WATCHDOG=1")
	notify.wait(t, "WATCHDOG=1")
	status := func(want int, lines ...string) {
		t.Helper()
		deadline := time.Now().Add(waitTimeout)
		for {
			code, out, errOut := runCmd("status", "-config", e.config)
			ok := code == want
			for _, l := range lines {
				ok = ok && strings.Contains(out+errOut, l)
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("kvmount status = %d\n%s%s\nwant %d and %q; daemon logs:\n%s", code, out, errOut, want, lines, logs)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	status(0, "app", "current")
	e.etcd.Stop()
	status(1, "app", "stale", "source main is down")
	notify.seen(t, "STATUS=1 mount: 1 stale (app: source \"main\"")
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit %v; logs:\n%s", err, logs)
	}
	status(2, "cannot be reached")
}
