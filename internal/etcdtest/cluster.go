package etcdtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvmount/kvmount/internal/testbin"
)

// Binary returns the etcd server binary that multi-member tests run as
// separate processes: $KVMOUNT_ETCD, else the build scripts/etcd-server.sh
// caches for the etcd version in go.mod. When there is none the test is
// skipped — or fails when CI=true, where a missing server must never pass
// unnoticed.
func Binary(tb testing.TB) string {
	tb.Helper()
	b := testbin.Binary{What: "etcd server binary", Env: "KVMOUNT_ETCD", Name: "etcd", Script: "scripts/etcd-server.sh"}
	if os.Getenv(b.Env) == "" {
		// The version in go.mod, as scripts/etcd-server.sh names its cache.
		out, err := exec.Command("go", "list", "-m", "-f", "{{.Version}}", "go.etcd.io/etcd/server/v3").Output()
		if err != nil {
			tb.Fatalf("go list -m go.etcd.io/etcd/server/v3: %v", err)
		}
		b.Dir = "etcd-" + strings.TrimSpace(string(out))
	}
	return b.Find(tb)
}

// Member is one member of a Cluster: an etcd process of its own.
type Member struct {
	Name      string
	ClientURL string
	bin       string
	args      []string
	cmd       *exec.Cmd
}

// Kill kills the member's process (SIGKILL, after a SIGCONT should it be
// frozen) and waits for its end; its data stays for Restart.
func (m *Member) Kill() {
	_ = m.cmd.Process.Signal(syscall.SIGCONT)
	_ = m.cmd.Process.Kill()
	_ = m.cmd.Wait()
}

// Restart starts a killed member again on its data, addresses and flags.
// It does not wait for the member to rejoin.
func (m *Member) Restart(tb testing.TB) {
	tb.Helper()
	m.cmd = exec.Command(m.bin, m.args...)
	if err := m.cmd.Start(); err != nil {
		tb.Fatal(err)
	}
}

// Pid returns the member's process ID.
func (m *Member) Pid() int { return m.cmd.Process.Pid }

// Freeze stops the member's process (SIGSTOP): it keeps its connections
// open and answers nothing, as a hung member does.
func (m *Member) Freeze(tb testing.TB) {
	tb.Helper()
	if err := m.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		tb.Fatal(err)
	}
}

// Thaw lets a frozen member go on (SIGCONT).
func (m *Member) Thaw(tb testing.TB) {
	tb.Helper()
	if err := m.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		tb.Fatal(err)
	}
}

// Cluster is an etcd cluster of separate processes on loopback ports.
type Cluster struct {
	Members []*Member
}

// Endpoints returns every member's client URL.
func (c *Cluster) Endpoints() []string {
	var eps []string
	for _, m := range c.Members {
		eps = append(eps, m.ClientURL)
	}
	return eps
}

// Client returns a client of the members given (all when none), closed when
// the test ends.
func (c *Cluster) Client(tb testing.TB, members ...*Member) *clientv3.Client {
	tb.Helper()
	if len(members) == 0 {
		members = c.Members
	}
	var eps []string
	for _, m := range members {
		eps = append(eps, m.ClientURL)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: eps, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}

// ByID returns the member whose ID is id, asked of the cluster through cli.
func (c *Cluster) ByID(tb testing.TB, cli *clientv3.Client, id uint64) *Member {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), Timeout)
	defer cancel()
	resp, err := cli.MemberList(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	for _, mem := range resp.Members {
		if mem.ID != id {
			continue
		}
		for _, m := range c.Members {
			if m.Name == mem.Name {
				return m
			}
		}
	}
	tb.Fatalf("no member with ID %x", id)
	return nil
}

// StartCluster starts an n-member cluster of etcd processes (Binary) with
// their data in temporary directories, on loopback ports, and waits until
// it has a leader; every member is killed when the test ends.
func StartCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	bin := Binary(tb)
	base := tb.TempDir()
	type ports struct{ client, peer string }
	addrs := freeAddrs(tb, 2*n)
	ps := make([]ports, n)
	for i := range ps {
		ps[i] = ports{addrs[2*i], addrs[2*i+1]}
	}
	var initial []string
	for i, p := range ps {
		initial = append(initial, fmt.Sprintf("m%d=http://%s", i, p.peer))
	}
	c := &Cluster{}
	for i, p := range ps {
		name := fmt.Sprintf("m%d", i)
		args := []string{
			"--name", name, "--data-dir", filepath.Join(base, name),
			"--listen-client-urls", "http://" + p.client, "--advertise-client-urls", "http://" + p.client,
			"--listen-peer-urls", "http://" + p.peer, "--initial-advertise-peer-urls", "http://" + p.peer,
			"--initial-cluster", strings.Join(initial, ","), "--initial-cluster-state", "new",
			"--initial-cluster-token", filepath.Base(base), "--log-level", "error"}
		m := &Member{Name: name, ClientURL: "http://" + p.client, bin: bin, args: args}
		m.Restart(tb)
		c.Members = append(c.Members, m)
		tb.Cleanup(m.Kill)
	}
	cli := c.Client(tb)
	deadline := time.Now().Add(Timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := cli.Put(ctx, "/etcdtest/ready", "1")
		cancel()
		if err == nil {
			return c
		}
		if time.Now().After(deadline) {
			tb.Fatalf("the %d-member cluster never took a write: %v", n, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// freeAddrs returns n distinct loopback addresses no one listens on now.
// Each listener stays open until all are chosen: closed one by one, the
// kernel may hand the same port out twice.
func freeAddrs(tb testing.TB, n int) []string {
	tb.Helper()
	addrs := make([]string, n)
	for i := range addrs {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		defer l.Close()
		addrs[i] = l.Addr().String()
	}
	return addrs
}
