package daemon

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/privsep"
)

// compromisedMode is the WorkerEnv value that starts compromisedWorker.
const compromisedMode = "compromised"

// attackLine names, in a configuration, the attack compromisedWorker makes
// ("# attack: NAME").
var attackLine = regexp.MustCompile(`(?m)^# attack: (\S+)$`)

// compromisedAttacks are what a compromised worker does to the monitor,
// by name (issue 36): each runs after a good payload of "v1" for the mount
// "app", on the worker's encoder and raw socket; a worker that returns
// from one exits. tokenFile is the credential file the configuration
// names.
var compromisedAttacks = map[string]func(e *privsep.Encoder, raw io.Writer, tokenFile string){
	// A mode of its choosing for a mount whose default_mode is 0400.
	"mode": func(e *privsep.Encoder, _ io.Writer, _ string) {
		e.Encode(&privsep.MountState{Mount: "app", Generation: 2, Revision: "main@mode"})
		e.Encode(&privsep.Begin{Mount: "app", Revision: "main@mode", Files: 1})
		e.EncodeFile("app.conf", 0o666, []byte("mode"))
		e.Encode(&privsep.Commit{})
		e.Flush()
		time.Sleep(2 * time.Second)
	},
	// 256 files of 1 MiB for a tmpfs of 1 MiB.
	"oversized": func(e *privsep.Encoder, _ io.Writer, _ string) {
		e.Encode(&privsep.Begin{Mount: "app", Revision: "main@big", Files: 256})
		data := bytes.Repeat([]byte("x"), 1<<20)
		for i := range 256 {
			if e.EncodeFile("f"+strconv.Itoa(i), 0o400, data) != nil {
				return
			}
		}
		e.Encode(&privsep.Commit{})
	},
	// The credential file asked for again and again, the answers unread.
	"credential_flood": func(e *privsep.Encoder, _ io.Writer, tokenFile string) {
		for range 1000 {
			if e.Encode(&privsep.Reread{Name: tokenFile}) != nil {
				return
			}
		}
		e.Flush()
		time.Sleep(5 * time.Second)
	},
	// A file the configuration does not name.
	"unknown_file": func(e *privsep.Encoder, _ io.Writer, _ string) {
		e.Encode(&privsep.Reread{Name: "/etc/shadow"})
		e.Flush()
		time.Sleep(5 * time.Second)
	},
	// 200,000 log lines at once.
	"log_flood": func(e *privsep.Encoder, _ io.Writer, _ string) {
		for i := range 200_000 {
			if e.Encode(&privsep.Log{Level: 8, Message: "flood", Attrs: []string{"n", strconv.Itoa(i)}}) != nil {
				return
			}
		}
		e.Flush()
		time.Sleep(2 * time.Second)
	},
	// Attributes that would stand for the monitor's own.
	"shadow": func(e *privsep.Encoder, _ io.Writer, _ string) {
		e.Encode(&privsep.Log{Level: 0, Message: "worker says", Attrs: []string{"msg", "check passed", "level", "ERROR", "time", "2000-01-01T00:00:00Z", "from", "monitor"}})
		e.Flush()
		time.Sleep(2 * time.Second)
	},
	// A child in a session of its own that holds the worker's output,
	// and the worker gone.
	"orphan": func(e *privsep.Encoder, _ io.Writer, _ string) {
		child := exec.Command("/bin/sleep", "60")
		child.Stdout, child.Stderr = os.Stdout, os.Stderr
		child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if err := child.Start(); err == nil {
			os.WriteFile(os.Getenv("KVMOUNT_TEST_ORPHAN"), []byte(strconv.Itoa(child.Process.Pid)), 0o644)
		}
		e.Encode(&privsep.Log{Level: 0, Message: "leaving a child behind"})
		e.Flush()
	},
}

// compromisedWorker is the fake worker of TestCompromisedWorker: it takes
// its configuration and says it applied it; the first one started then
// sends a good payload of "v1" for the mount "app" and makes the attack
// its configuration names (attackLine); the next ones send "v2" and wait.
func compromisedWorker() {
	conn := privsep.WorkerConn()
	d := privsep.NewDecoder(conn, privsep.FromMonitor)
	var seq uint32
	var text string
	for seq == 0 {
		m, err := d.Decode()
		if err != nil {
			os.Exit(1)
		}
		switch m := m.(type) {
		case *privsep.Input:
			if strings.HasSuffix(m.Name, "kvmount.toml") {
				text = string(m.Value)
			}
		case *privsep.Apply:
			seq = m.Seq
		}
	}
	e := privsep.NewEncoder(conn)
	e.Encode(&privsep.Applied{Seq: seq})
	good := func(content string) {
		e.Encode(&privsep.MountState{Mount: "app", Generation: 1, Revision: "main@" + content})
		e.Encode(&privsep.Begin{Mount: "app", Revision: "main@" + content, Files: 1})
		e.EncodeFile("app.conf", 0o644, []byte(content))
		e.Encode(&privsep.Commit{})
		e.Flush()
	}
	name := attackLine.FindStringSubmatch(text)
	if seq > 1 {
		if name != nil && name[1] == "orphan" {
			time.Sleep(2 * time.Second) // the test reads /status meanwhile
		}
		good("v2")
		io.Copy(io.Discard, conn)
		os.Exit(0)
	}
	if name == nil || name[1] != "mode" {
		good("v1")
	}
	token := regexp.MustCompile(`token_file = "([^"]+)"`).FindStringSubmatch(text)
	if name != nil && token != nil && compromisedAttacks[name[1]] != nil {
		compromisedAttacks[name[1]](e, conn, token[1])
	}
	os.Exit(0)
}

// TestCompromisedWorker is issue 36's compromised worker, against a whole
// daemon: a worker that sends what an attacker with code execution in it
// would — a mode of its own, a payload far past its mount's size, a
// credential asked for a thousand times without reading the answers, a
// file the configuration does not name, a flood of log lines, attributes that stand for
// the monitor's, a child left holding its output — finds the monitor
// deciding everything itself: modes from the configuration, the payload
// refused as soon as it passes the mount's size (at its second file), the
// second request for a credential and a request for any other file
// refused and the worker stopped, its log lines paced with a count of what was
// dropped and its attributes in a group of their own, its end noticed
// within a second whatever it left behind, the mount reported stale until
// the next worker reports it. The mount keeps its content throughout, and
// the next worker's payload is projected.
func TestCompromisedWorker(t *testing.T) {
	for _, attack := range []string{"mode", "oversized", "credential_flood", "unknown_file", "log_flood", "shadow", "orphan"} {
		t.Run(attack, func(t *testing.T) {
			h := newHarness(t)
			token := h.path("vault-token")
			if err := os.WriteFile(token, []byte("t\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			orphan := h.path("orphan.pid")
			t.Setenv("KVMOUNT_TEST_ORPHAN", orphan)
			t.Cleanup(func() {
				if b, err := os.ReadFile(orphan); err == nil {
					pid, _ := strconv.Atoi(string(b))
					syscall.Kill(pid, syscall.SIGKILL)
				}
			})
			h.sources = func() string {
				return fmt.Sprintf("# attack: %s\n[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n[sources.v]\ntype = \"vault\"\naddress = \"http://127.0.0.1:1\"\ntoken_file = %q\n",
					attack, h.endpoint, token)
			}
			h.writeConfig(h.mount("app", "/apps/app/", `medium = "tmpfs"`, `size_limit = "1MiB"`, `default_mode = "0400"`))
			h.workerMode = compromisedMode
			dir := h.path("mnt", "app")
			t.Cleanup(func() { syscall.Unmount(dir, syscall.MNT_DETACH) })
			h.start()
			if attack != "mode" {
				h.waitContent(dir, map[string]string{"app.conf": "v1"})
				checkMode(t, dir, 0o400)
			}
			switch attack {
			case "mode":
				h.waitContent(dir, map[string]string{"app.conf": "mode"})
				checkMode(t, dir, 0o400)
			case "oversized":
				h.waitLog("the worker broke the protocol", `file \"f1\" takes the payload past max_mount_size (1048576 bytes)`)
			case "credential_flood":
				h.waitLog("the worker broke the protocol", "asked for "+token+" again before the answer to its last request was sent")
			case "unknown_file":
				h.waitLog("the worker broke the protocol", "the worker asked for /etc/shadow, which the configuration does not name")
			case "log_flood":
				h.waitLog("dropped log lines of the worker")
				if n := h.logs.Count("msg=flood", "from=worker"); n > relayBurst+int(relayRate)*10 || n == 200_000 {
					t.Errorf("%d of 200000 flood lines relayed; want at most the burst and the rate", n)
				}
			case "shadow":
				h.waitLog(`msg="worker says"`, `worker.msg="check passed"`, "worker.level=ERROR", "worker.from=monitor", "from=worker")
				if h.logs.Count(" level=ERROR", "worker says") != 0 || h.logs.Count(` msg="check passed"`) != 0 {
					t.Error("a worker attribute stood for the monitor's own")
				}
			case "orphan":
				h.waitLog("leaving a child behind")
				left := time.Now()
				h.waitLog("the worker ended; starting it again")
				if took := time.Since(left); took > 2*time.Second {
					t.Errorf("the worker's end noticed %v after it left; want within a second", took)
				}
				h.waitAdmin(h.statusSocket(), "/status", `"state": "stale"`)
			}
			h.waitContent(dir, map[string]string{"app.conf": "v2"})
			checkMode(t, dir, 0o400)
		})
	}
}

// checkMode fails the test unless dir's app.conf has mode want.
func checkMode(t *testing.T, dir string, want os.FileMode) {
	t.Helper()
	st, err := os.Stat(filepath.Join(dir, "app.conf"))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != want {
		t.Errorf("app.conf has mode %v; want %v (the configuration's, not the worker's)", st.Mode().Perm(), want)
	}
}
