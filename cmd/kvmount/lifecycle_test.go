package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// notifySocket listens where a Type=notify service's NOTIFY_SOCKET points
// and collects the datagrams sd_notify sends.
type notifySocket struct {
	path string
	msgs chan string
}

func listenNotify(t *testing.T) *notifySocket {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	n := &notifySocket{path: path, msgs: make(chan string, 100)}
	go func() {
		buf := make([]byte, 4096)
		for {
			k, err := conn.Read(buf)
			if err != nil {
				return
			}
			n.msgs <- string(buf[:k])
		}
	}()
	return n
}

// wait waits for a message holding want.
func (n *notifySocket) wait(t *testing.T, want string) {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		select {
		case m := <-n.msgs:
			if strings.Contains(m, want) {
				return
			}
		case <-deadline:
			t.Fatalf("no %q on NOTIFY_SOCKET", want)
		}
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

// TestLifecycle runs the binary as systemd would: READY=1 once projected,
// RELOADING=1 and READY=1 around SIGHUP, STOPPING=1 as soon as SIGTERM
// arrives even while a check command holds a write; a second SIGTERM kills
// that command and the daemon exits 0 with the mount's last content.
func TestLifecycle(t *testing.T) {
	e := newEnv(t)
	notify := listenNotify(t)
	e.put("/app/a", "1")
	cfg := fmt.Sprintf(`state_dir = %q
[admin]
address = ""
[sources.main]
type = "etcd"
endpoints = [%q]
[[mount]]
name = "app"
dir = %q
source = "main"
prefix = "/app/"
check_command = ["sh", "-c", "test ! -e {{dir}}/slow || exec sleep 60"]
check_timeout = "5m"
`, filepath.Join(e.base, "state"), e.etcd.Endpoint(), e.dir("app"))
	if err := os.WriteFile(e.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
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
	cfg := fmt.Sprintf(`state_dir = %q
[admin]
address = ""
[sources.main]
type = "etcd"
endpoints = [%q]
[[mount]]
name = "app"
dir = %q
source = "main"
prefix = "/app/"
check_command = ["sh", "-c", "test ! -e {{dir}}/slow || exec sleep 1"]
`, filepath.Join(e.base, "state"), e.etcd.Endpoint(), e.dir("app"))
	if err := os.WriteFile(e.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
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
