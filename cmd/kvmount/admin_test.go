package main

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/internal/testlog"
)

// freePort returns a loopback address no one listens on now.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// perl runs a perl script as u in the background until the test ends.
func perl(t *testing.T, u roottest.User, script string) *exec.Cmd {
	t.Helper()
	cmd := u.Command("perl", "-MIO::Socket::INET", "-MIO::Socket::UNIX", "-e", script)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	return cmd
}

// impostor is a perl HTTP server that answers every request with a /status
// claiming every mount current.
const impostor = `while ($c = $s->accept) { <$c>; print $c "HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"ready\":true,\"mounts\":{\"app\":{\"state\":\"current\"}}}"; close $c }`

// TestAdminCannotBeSquattedOrStarved plays the review's findings 6 and 9 as
// a real unprivileged user against the binary, run with 128 file
// descriptors: a user who takes the admin port first does not keep
// kvmount from starting and projecting, is reported by kvmount status
// (which reads the root-only socket, not the port), and loses the port to
// kvmount once they let go; a thousand idle connections to the port do not
// hold up a projection; and kvmount status refuses a socket a user serves.
func TestAdminCannotBeSquattedOrStarved(t *testing.T) {
	u := roottest.NewUser(t)
	e := newEnv(t)
	addr := freePort(t)
	squatter := perl(t, u, fmt.Sprintf(`$s = IO::Socket::INET->new(LocalAddr => "%s", Listen => 5, ReuseAddr => 1) or die; %s`, addr, impostor))
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the squatter never listened")
		}
	}
	e.put("/app/a", "1")
	e.writeAppConfig(addr, "")
	cmd := exec.Command("sh", "-c", `ulimit -n 128 && exec "$0" "$@"`, kvmountBin, "run", "-config", e.config)
	logs := &testlog.Buffer{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	})
	waitFile(t, filepath.Join(e.dir("app"), "a"), "1")
	status := func(want int, parts ...string) {
		t.Helper()
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(50 * time.Millisecond) {
			code, out, errOut := runCmd("status", "-config", e.config)
			ok := code == want
			for _, p := range parts {
				ok = ok && strings.Contains(out+errOut, p)
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("kvmount status = %d %q %q; want %d with %q", code, out, errOut, want, parts)
			}
		}
	}
	status(1, "app", "current", "admin endpoint "+addr+" does not listen", "address already in use")
	squatter.Process.Kill()
	squatter.Wait()
	status(0, "app", "current")
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		t.Fatalf("kvmount's /readyz after the squatter left: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("kvmount's /readyz after the squatter left = %d", resp.StatusCode)
	}

	// A thousand idle connections, reopened as the server drops them.
	flood := perl(t, u, fmt.Sprintf(`my @c; my $end = time + 10; while (time < $end) { @c = grep { defined $_->connected } @c; for (1..100) { last if @c >= 1000; my $c = IO::Socket::INET->new(PeerAddr => "%s", Timeout => 1); push @c, $c if $c; } select(undef, undef, undef, 0.05); }`, addr))
	time.Sleep(2 * time.Second)
	for _, v := range []string{"2", "3", "4"} {
		start := time.Now()
		e.put("/app/a", v)
		for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if data, _ := os.ReadFile(filepath.Join(e.dir("app"), "a")); string(data) == v {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("a change was not projected within 2 s during the flood; logs:\n%s", logs)
			}
		}
		t.Logf("projected during the flood in %v", time.Since(start))
		time.Sleep(time.Second)
	}
	status(0, "app", "current")
	flood.Wait()

	// kvmount status believes no socket a user serves.
	dir := filepath.Join(roottest.TempDir(t), "userdir")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, dir)
	fake := filepath.Join(dir, "kvmount.sock")
	perl(t, u, fmt.Sprintf(`$s = IO::Socket::UNIX->new(Local => "%s", Listen => 5) or die; %s`, fake, impostor))
	// Listening, not only bound: the file appears at bind, before listen.
	// (Asked of the kernel, not by connecting: the impostor would write to
	// a probe that hung up, and die of SIGPIPE.)
	for deadline := time.Now().Add(waitTimeout); !listening(t, fake); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the impostor socket never listened")
		}
	}
	cfg := filepath.Join(e.base, "impostor.toml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("[admin]\nsocket = %q\n", fake)), 0o644); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := runCmd("status", "-config", cfg); code != 2 || !strings.Contains(errOut, "not root: not kvmount") {
		t.Errorf("kvmount status against a user's socket = %d %q %q; want 2, refused", code, out, errOut)
	}
}

// listening reports whether a unix socket bound to path listens, from
// /proc/net/unix (flag __SO_ACCEPTCON, 0x10000).
func listening(t *testing.T, path string) bool {
	t.Helper()
	table, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(table), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 8 || f[7] != path {
			continue
		}
		if flags, err := strconv.ParseUint(f[3], 16, 32); err == nil && flags&0x10000 != 0 {
			return true
		}
	}
	return false
}
