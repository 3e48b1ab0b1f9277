package daemon

import (
	"bytes"
	"encoding/binary"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/internal/escapetest"
	"github.com/kvmount/kvmount/privsep"
)

func init() { afterConfine = tryEscapes }

// escapeMount is the mount whose presence makes the daemon's worker try
// its ways out (tryEscapes).
const escapeMount = "escape-attempts"

// tryEscapes is the worker's test hook (afterConfine): in a configuration
// with a mount named escapeMount, the confined worker tries what a
// compromised one would, and logs each result; the monitor logs them,
// from the worker.
func tryEscapes(cfg *config.Config, log *slog.Logger) {
	if !slices.ContainsFunc(cfg.Mounts, func(m *config.Mount) bool { return m.Name == escapeMount }) {
		return
	}
	// Port 1 of loopback is no store's: Landlock refuses the connection
	// before anything could refuse it there.
	for name, result := range escapetest.Run(escapetest.Attempts(os.Getppid(), "127.0.0.1:1")) {
		log.Info("escape attempt", "attempt", name, "result", result)
	}
}

// TestWorkerCannotEscape: the daemon's own worker, as the monitor starts
// it and once it is confined, tries to open /etc/shadow, write under /root
// and /tmp, mount, signal PID 1, ptrace the monitor, make a user
// namespace, execute a program, change its ids and connect to an address
// no source names: each is refused, and the mount projects as ever.
func TestWorkerCannotEscape(t *testing.T) {
	h := newHarness(t)
	h.put("/apps/app/app.conf", "v1")
	h.writeConfig(h.mount(escapeMount, "/apps/app/"))
	h.start()
	h.waitContent(h.path("mnt", escapeMount), map[string]string{"app.conf": "v1"})
	for name, want := range escapetest.Refusals {
		// slog's text handler quotes a value with a space.
		attempt := "attempt=" + name + " "
		if strings.Contains(name, " ") {
			attempt = "attempt=" + strconv.Quote(name) + " "
		}
		h.waitLog("escape attempt", "from=worker", attempt)
		if h.logs.Count("escape attempt", attempt, want.Error()) != 1 {
			t.Errorf("%s: not refused with %v", name, want)
		}
	}
	h.put("/apps/app/app.conf", "v2")
	h.waitContent(h.path("mnt", escapeMount), map[string]string{"app.conf": "v2"})
}

// hostileMode is the WorkerEnv value that starts hostileWorker.
const hostileMode = "hostile"

// hostileAttacks are what hostileWorker sends after a good payload: the
// nth worker started sends the nth attack, each written to the monitor's
// socket as raw frames; from the worker after the last on, a good payload
// of "v2" and nothing else.
var hostileAttacks = []func(e *privsep.Encoder, raw io.Writer){
	// A path out of the mount.
	func(e *privsep.Encoder, _ io.Writer) {
		e.Encode(&privsep.Begin{Mount: "app", Revision: "evil", Files: 1})
		e.EncodeFile("../escape", 0o644, []byte("evil"))
		e.Encode(&privsep.Commit{})
	},
	// An absolute path.
	func(e *privsep.Encoder, _ io.Writer) {
		e.Encode(&privsep.Begin{Mount: "app", Revision: "evil", Files: 1})
		e.EncodeFile("/tmp/kvmount-hostile-escape", 0o644, []byte("evil"))
		e.Encode(&privsep.Commit{})
	},
	// 10⁶ files.
	func(e *privsep.Encoder, _ io.Writer) {
		e.Encode(&privsep.Begin{Mount: "app", Revision: "evil", Files: 1_000_000})
		for i := range 1_000_000 {
			if e.Encode(&privsep.File{Path: "f" + strconv.Itoa(i), Mode: 0o644}) != nil {
				return
			}
		}
		e.Encode(&privsep.Commit{})
	},
	// A frame of 2 GiB.
	func(e *privsep.Encoder, raw io.Writer) {
		e.Flush()
		hdr := binary.BigEndian.AppendUint32(nil, 2<<30)
		raw.Write(append(hdr, frameType(&privsep.Data{})))
	},
	// A payload of a mount the configuration does not have.
	func(e *privsep.Encoder, _ io.Writer) {
		e.Encode(&privsep.Begin{Mount: "ghost", Revision: "evil", Files: 1})
		e.EncodeFile("ghost.conf", 0o644, []byte("evil"))
		e.Encode(&privsep.Commit{})
	},
	// A frame cut short, and the worker gone.
	func(e *privsep.Encoder, raw io.Writer) {
		e.Flush()
		var frame bytes.Buffer
		fe := privsep.NewEncoder(&frame)
		fe.Encode(&privsep.Begin{Mount: "app", Revision: "evil", Files: 1})
		fe.Flush()
		raw.Write(frame.Bytes()[:frame.Len()-3])
		os.Exit(0)
	},
}

// hostileRefusals are the monitor's log lines for each of hostileAttacks.
var hostileRefusals = [][]string{
	{`must not start with '..'`, "../escape"},
	{"must be a relative path", "/tmp/kvmount-hostile-escape"},
	{"1000000 files, more than", "max_files"},
	{"a body of 2147483648 bytes"},
	{`a payload for mount \"ghost\", which the configuration does not have`},
	{"frame cut short"},
}

// frameType returns the type byte of m's frames.
func frameType(m privsep.Message) byte {
	var b bytes.Buffer
	e := privsep.NewEncoder(&b)
	e.Encode(m)
	e.Flush()
	return b.Bytes()[4]
}

// hostileWorker is the fake worker of TestHostileWorker: it takes its
// configuration, says it applied it, sends a good payload of "v1" for the
// mount "app" and then the attack of its start (the first Apply's Seq),
// and waits for the monitor to end it.
func hostileWorker() {
	conn := privsep.WorkerConn()
	seq := awaitApply(conn)
	e := privsep.NewEncoder(conn)
	e.Encode(&privsep.Applied{Seq: seq})
	good := func(content string) {
		e.Encode(&privsep.MountState{Mount: "app", Generation: 1, Revision: "main@" + content})
		e.Encode(&privsep.Begin{Mount: "app", Revision: "main@" + content, Files: 1})
		e.EncodeFile("app.conf", 0o644, []byte(content))
		e.Encode(&privsep.Commit{})
	}
	if n := int(seq) - 1; n < len(hostileAttacks) {
		good("v1")
		hostileAttacks[n](e, conn)
	} else {
		good("v2")
	}
	e.Flush()
	io.Copy(io.Discard, conn)
	os.Exit(0)
}

// TestHostileWorker is issue 28's hostile worker, against a whole daemon:
// a worker that sends a path out of its mount, an absolute path, 10⁶
// files, a 2 GiB frame, a payload of a mount that does not exist and a
// frame cut short is refused each time with a clear log line, stopped and
// started again; the mount keeps its content throughout, nothing is
// written outside it, /status counts the refusals, and the next worker's
// good payload is projected.
func TestHostileWorker(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("app", "/apps/app/"))
	h.workerMode = hostileMode
	h.start()
	dir := h.path("mnt", "app")
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	for i, parts := range hostileRefusals {
		h.waitLog(append([]string{"the worker broke the protocol; stopping it, and keeping every mount's content"}, parts...)...)
		if got, _ := content(dir); got["app.conf"] != "v1" || len(got) != 1 {
			t.Fatalf("after attack %d the mount holds %v", i+1, got)
		}
	}
	h.waitContent(dir, map[string]string{"app.conf": "v2"})
	for _, p := range []string{h.path("mnt", "escape"), "/tmp/kvmount-hostile-escape", h.path("mnt", "ghost")} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s exists", p)
		}
	}
	if w := workerStatus(t, h); w.Refusals != uint64(len(hostileAttacks)) || w.Starts != uint64(len(hostileAttacks))+1 {
		t.Errorf("/status: %d refusals, %d starts; want %d and %d", w.Refusals, w.Starts, len(hostileAttacks), len(hostileAttacks)+1)
	}
}

// awaitApply reads what the monitor sends a fake worker on conn until its
// first Apply, and returns that Apply's Seq; it exits the process when
// the link fails first.
func awaitApply(conn io.Reader) uint32 {
	d := privsep.NewDecoder(conn, privsep.FromMonitor)
	for {
		m, err := d.Decode()
		if err != nil {
			os.Exit(1)
		}
		if a, ok := m.(*privsep.Apply); ok && a.Seq != 0 {
			return a.Seq
		}
	}
}
