package topology

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/internal/testlog"
)

// waitTimeout bounds every wait of these tests that is not a measured bar.
const waitTimeout = 60 * time.Second

// kvmountd is the kvmount binary run as a daemon (kvmount run), with its
// worker, a state directory of its own and its private admin socket.
type kvmountd struct {
	t      testing.TB
	base   string
	config string
	cmd    *exec.Cmd
	done   chan struct{}
	logs   *testlog.Buffer
}

// newKvmountd writes a configuration of the sources and mounts in body
// (TOML), below a state directory and an admin socket of its own; mount
// directories are below dir(name), on tmpfs, unmounted when the test
// ends.
func newKvmountd(t testing.TB, body string) *kvmountd {
	t.Helper()
	base := roottest.TempDir(t)
	d := &kvmountd{t: t, base: base, config: filepath.Join(base, "kvmount.toml"), logs: &testlog.Buffer{}}
	text := fmt.Sprintf("state_dir = %q\nlog_level = \"debug\"\n[admin]\naddress = \"\"\nsocket = %q\n%s", filepath.Join(base, "state"), d.socket(), body)
	if err := os.WriteFile(d.config, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.kill()
		roottest.UnmountUnder(t, base)
		if t.Failed() || os.Getenv("KVMOUNT_TOPOLOGY_LOGS") != "" {
			t.Logf("kvmount logs:\n%s", d.logs)
		}
	})
	return d
}

// dir returns the directory of the mount name.
func (d *kvmountd) dir(name string) string { return filepath.Join(d.base, "mnt", name) }

// tmpfsMount returns a [[mount]] table on tmpfs named name, unmounted when
// the test ends (after the daemon is killed); extra are more of its lines.
func (d *kvmountd) tmpfsMount(name string, extra string) string {
	return fmt.Sprintf("[[mount]]\nname = %q\ndir = %q\nmedium = \"tmpfs\"\n%s\n", name, d.dir(name), extra)
}

func (d *kvmountd) socket() string { return filepath.Join(d.base, "run", "kvmount.sock") }

// start runs kvmount run.
func (d *kvmountd) start() {
	d.t.Helper()
	cmd := exec.Command(kvmountBin, "run", "-config", d.config)
	cmd.Stdout, cmd.Stderr = d.logs, d.logs
	if err := cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	d.cmd, d.done = cmd, done
}

// kill kills the daemon (SIGKILL), as a crash or the OOM killer would,
// and waits until its worker, which outlives it by at most a moment, is
// gone too.
func (d *kvmountd) kill() {
	if d.cmd == nil {
		return
	}
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.done
	d.cmd = nil
}

// status returns the daemon's /status, nil when it does not answer.
func (d *kvmountd) status() *admin.Status {
	client := http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var dl net.Dialer
			return dl.DialContext(ctx, "unix", d.socket())
		},
	}}
	defer client.CloseIdleConnections()
	resp, err := client.Get("http://kvmount/status")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	var st admin.Status
	if json.NewDecoder(resp.Body).Decode(&st) != nil {
		return nil
	}
	return &st
}

// state returns the state /status gives the mount name, "" when the
// daemon does not answer.
func (d *kvmountd) state(name string) string {
	st := d.status()
	if st == nil || st.Mounts[name] == nil {
		return ""
	}
	return st.Mounts[name].State
}

// waitState waits until the mount's state is want, and returns how long
// that took; it fails the test after limit.
func (d *kvmountd) waitState(name, want string, limit time.Duration) time.Duration {
	d.t.Helper()
	start := time.Now()
	for {
		if d.state(name) == want {
			return time.Since(start)
		}
		if time.Since(start) > limit {
			d.t.Fatalf("mount %s not %s after %v (state %q)", name, want, limit, d.state(name))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// states records, until ctx is done, every change of the mounts' states
// in /status, polled every 100 ms.
type states struct {
	mu      sync.Mutex
	changes map[string][]stateChange
}

// stateChange is a mount's state from a time on.
type stateChange struct {
	at    time.Time
	state string
}

func (s *states) watch(ctx context.Context, d *kvmountd, mounts ...string) {
	s.mu.Lock()
	s.changes = map[string][]stateChange{}
	s.mu.Unlock()
	for ctx.Err() == nil {
		st := d.status()
		now := time.Now()
		s.mu.Lock()
		for _, m := range mounts {
			state := ""
			if st != nil && st.Mounts[m] != nil {
				state = st.Mounts[m].State
			}
			if c := s.changes[m]; len(c) == 0 || c[len(c)-1].state != state {
				s.changes[m] = append(c, stateChange{now, state})
			}
		}
		s.mu.Unlock()
		time.Sleep(100 * time.Millisecond)
	}
}

// during returns a time in [from, to] at which mount was in state, and
// whether there was one.
func (s *states) during(mount, state string, from, to time.Time) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.changes[mount]
	for i, ch := range c {
		end := time.Now()
		if i+1 < len(c) {
			end = c[i+1].at
		}
		if ch.state == state && ch.at.Before(to) && end.After(from) {
			if ch.at.Before(from) {
				return from, true
			}
			return ch.at, true
		}
	}
	return time.Time{}, false
}

// String returns each mount's changes, for the log.
func (s *states) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var b strings.Builder
	for _, m := range slices.Sorted(maps.Keys(s.changes)) {
		fmt.Fprintf(&b, "%s:", m)
		for _, c := range s.changes[m] {
			fmt.Fprintf(&b, " %s %s", c.at.Format("15:04:05.0"), c.state)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// first returns when mount was first seen in state at or after from, and
// false when it was not.
func (s *states) first(mount, state string, from time.Time) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.changes[mount]
	for i, ch := range c {
		end := time.Now()
		if i+1 < len(c) {
			end = c[i+1].at
		}
		if ch.state == state && end.After(from) {
			if ch.at.Before(from) {
				return from, true
			}
			return ch.at, true
		}
	}
	return time.Time{}, false
}
