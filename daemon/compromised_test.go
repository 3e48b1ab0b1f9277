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

// compromisedMode is the WorkerEnv value that starts compromisedWorker,
// followed by ":", the attack it makes, ":" and the credential file of
// the domain "v" (which the worker of "main" is not given).
const compromisedMode = "compromised"

// compromisedAttacks are what a compromised worker of the domain "main"
// does to the monitor, by name (issue 36): each runs after a good payload
// of "v1" for the mount "app", on the worker's encoder and raw socket; a
// worker that returns from one exits. tokenFile is the credential file
// of the configuration's other domain, "v".
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
	// The credential file of the other domain.
	"foreign_file": func(e *privsep.Encoder, _ io.Writer, tokenFile string) {
		e.Encode(&privsep.Reread{Name: tokenFile})
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
	// and the worker gone. The child ends by itself, well after the
	// test has seen the worker's end noticed.
	"orphan": func(e *privsep.Encoder, _ io.Writer, _ string) {
		child := exec.Command("/bin/sleep", "15")
		child.Stdout, child.Stderr = os.Stdout, os.Stderr
		child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		_ = child.Start()
		e.Encode(&privsep.Log{Level: 0, Message: "leaving a child behind"})
		e.Flush()
	},
}

// vaultAttacks are what a compromised worker of the domain "v", whose
// source reads tokenFile, does to the monitor, by name.
var vaultAttacks = map[string]func(e *privsep.Encoder, tokenFile string){
	// Its credential file asked for again and again, the answers unread.
	"credential_flood": func(e *privsep.Encoder, tokenFile string) {
		for range 1000 {
			if e.Encode(&privsep.Reread{Name: tokenFile}) != nil {
				return
			}
		}
	},
	// A file the configuration does not name.
	"unknown_file": func(e *privsep.Encoder, _ string) {
		e.Encode(&privsep.Reread{Name: "/etc/shadow"})
	},
	// A payload for a mount of the other domain, which it does not serve.
	"foreign_payload": func(e *privsep.Encoder, _ string) {
		e.Encode(&privsep.MountState{Mount: "app", Generation: 9, Revision: "v@evil"})
		e.Encode(&privsep.Begin{Mount: "app", Revision: "v@evil", Files: 1})
		e.EncodeFile("app.conf", 0o644, []byte("evil"))
		e.Encode(&privsep.Commit{})
	},
	// The other domain's mount said to hold on disk what it holds
	// (Unchanged), at a digest of its choosing.
	"foreign_unchanged": func(e *privsep.Encoder, _ string) {
		e.Encode(&privsep.Unchanged{Mount: "app", Generation: 9, Digest: strings.Repeat("0", 64), Size: 1})
	},
}

// compromisedWorker is the fake worker of TestCompromisedWorker, making
// attack: it takes its configuration, says it applied it and logs the
// names of the files it was given. The first worker of the domain "main"
// then sends a good payload of "v1" for the mount "app" and makes the
// attack, if it is one of compromisedAttacks; the next ones send "v2" and
// wait. The first worker of the domain "v" makes the attack, if it is one
// of vaultAttacks; the others wait.
func compromisedWorker(attack, tokenFile string) {
	conn := privsep.WorkerConn()
	d := privsep.NewDecoder(conn, privsep.FromMonitor)
	var seq uint32
	var text string
	var given []string
	for seq == 0 {
		m, err := d.Decode()
		if err != nil {
			os.Exit(1)
		}
		switch m := m.(type) {
		case *privsep.Input:
			given = append(given, m.Name)
			if strings.HasSuffix(m.Name, "kvmount.toml") {
				text = string(m.Value)
			}
		case *privsep.Apply:
			seq = m.Seq
		}
	}
	e := privsep.NewEncoder(conn)
	e.Encode(&privsep.Applied{Seq: seq})
	e.Encode(&privsep.Log{Level: 0, Message: "given", Attrs: []string{"inputs", strings.Join(given, " ")}})
	e.Flush()
	token := regexp.MustCompile(`token_file = "([^"]+)"`).FindStringSubmatch(text)
	if os.Args[len(os.Args)-1] == "v" {
		if attack := vaultAttacks[attack]; attack != nil && seq == 1 && token != nil {
			attack(e, token[1])
			e.Flush()
		}
		io.Copy(io.Discard, conn)
		os.Exit(0)
	}
	good := func(content string) {
		e.Encode(&privsep.MountState{Mount: "app", Generation: 1, Revision: "main@" + content})
		e.Encode(&privsep.Begin{Mount: "app", Revision: "main@" + content, Files: 1})
		e.EncodeFile("app.conf", 0o644, []byte(content))
		e.Encode(&privsep.Commit{})
		e.Flush()
	}
	if seq > 1 {
		if attack == "orphan" {
			time.Sleep(2 * time.Second) // the test reads /status meanwhile
		}
		good("v2")
		io.Copy(io.Discard, conn)
		os.Exit(0)
	}
	if attack != "mode" {
		good("v1")
	}
	if compromisedAttacks[attack] == nil {
		io.Copy(io.Discard, conn)
		os.Exit(0)
	}
	compromisedAttacks[attack](e, conn, tokenFile)
	os.Exit(0)
}

// TestCompromisedWorker is issue 36's compromised worker, against a whole
// daemon whose configuration has two trust domains: "main" (an etcd
// source and the mount "app") and "v" (a Vault source, its token file).
// A worker that sends what an attacker with code execution in it would —
// a mode of its own, a payload far past its mount's size, a credential
// asked for a thousand times without reading the answers, a file the
// configuration does not name, the other domain's credential file, a
// payload for the other domain's mount or its word that that mount holds
// its payload on disk already (Unchanged), a flood of log lines, attributes
// that stand for the monitor's, a child left holding its output — finds
// the monitor deciding everything itself: modes from the configuration,
// the payload refused as soon as it passes the mount's size (at its
// second file), the second request for a credential and a request for
// any other file refused and the worker stopped, a mount taken from the
// worker of its domain alone, its log lines paced with a count of what
// was dropped and its attributes in a group of their own, its end noticed
// within a second whatever it left behind, the mount reported stale until
// the next worker reports it. Each worker is given its domain's files
// alone; a breach stops only the worker that made it. The mount keeps its
// content throughout, and the next worker's payload is projected.
func TestCompromisedWorker(t *testing.T) {
	for _, attack := range []string{"mode", "oversized", "credential_flood", "unknown_file", "foreign_file", "foreign_payload", "foreign_unchanged", "log_flood", "shadow", "orphan"} {
		t.Run(attack, func(t *testing.T) {
			h := newHarness(t)
			token := h.path("vault-token")
			if err := os.WriteFile(token, []byte("t\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			h.sources = func() string {
				return fmt.Sprintf("[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n[sources.v]\ntype = \"vault\"\naddress = \"http://127.0.0.1:1\"\ntoken_file = %q\n",
					h.endpoint, token)
			}
			h.writeConfig(h.mount("app", "/apps/app/", `medium = "tmpfs"`, `size_limit = "1MiB"`, `default_mode = "0400"`))
			h.workerMode = compromisedMode + ":" + attack + ":" + token
			dir := h.path("mnt", "app")
			h.start()
			if attack != "mode" {
				h.waitContent(dir, map[string]string{"app.conf": "v1"})
				checkMode(t, dir, 0o400)
			}
			// Each worker was given its domain's files: the token file
			// reached the worker of "v" alone.
			h.waitLog("msg=given", "domain=v", token)
			h.waitLog("msg=given", "domain=main")
			if n := h.logs.Count("msg=given", "domain=main", token); n != 0 {
				t.Errorf("the worker of main was given v's token file:\n%s", h.logs)
			}
			breach := func(domain, why string) {
				t.Helper()
				h.waitLog("the worker broke the protocol", "domain="+domain, why)
			}
			switch attack {
			case "mode":
				h.waitContent(dir, map[string]string{"app.conf": "mode"})
				checkMode(t, dir, 0o400)
			case "oversized":
				breach("main", `file \"f1\" takes the payload past max_mount_size (1048576 bytes)`)
			case "credential_flood":
				breach("v", "asked for "+token+" again before the answer to its last request was sent")
			case "unknown_file":
				breach("v", "the worker asked for /etc/shadow, which the configuration of its domain does not name")
			case "foreign_file":
				breach("main", "the worker asked for "+token+", which the configuration of its domain does not name")
			case "foreign_payload", "foreign_unchanged":
				breach("v", `the worker of domain v reported mount \"app\", which is not of its domain`)
			case "log_flood":
				h.waitLog("dropped log lines of the worker")
				if n := h.logs.Count("msg=flood", "from=worker"); n > privsep.RelayBurst+int(privsep.RelayRate)*10 || n == 200_000 {
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
			if vaultAttacks[attack] != nil {
				// The worker of v was stopped and started again; main's
				// ran on, and the mount kept its content.
				h.waitMetric(h.statusSocket(), `kvmount_worker_refusals_total{domain="v"} 1`)
				h.waitMetric(h.statusSocket(), `kvmount_worker_starts_total{domain="v"} 2`)
				h.waitMetric(h.statusSocket(), `kvmount_worker_starts_total{domain="main"} 1`)
				if got, _ := content(dir); got["app.conf"] != "v1" {
					t.Errorf("the mount holds %v after the attack of v's worker", got)
				}
				return
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
