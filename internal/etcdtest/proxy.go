package etcdtest

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Proxy is an etcd gRPC proxy (etcd grpc-proxy start) in front of a
// Cluster: the process etcd documents for many clients watching the same
// keys, which coalesces their watches into one watch on a member. It is
// the etcd server binary (Binary) run in its proxy mode.
type Proxy struct {
	// Addr is the proxy's client address (host:port, plain HTTP/2).
	Addr string
	tb   testing.TB
	args []string
	cmd  *exec.Cmd
}

// StartProxy starts a gRPC proxy in front of every member of c, listening
// on a free loopback port, waits until it serves a read, and kills it
// when the test ends. args are added to the proxy's command line (e.g.
// --dial-keepalive-time).
func StartProxy(tb testing.TB, c *Cluster, args ...string) *Proxy {
	tb.Helper()
	var eps []string
	for _, m := range c.Members {
		eps = append(eps, strings.TrimPrefix(m.ClientURL, "http://"))
	}
	p := &Proxy{Addr: freeAddrs(tb, 1)[0], tb: tb}
	p.args = append([]string{"grpc-proxy", "start",
		"--endpoints", strings.Join(eps, ","),
		"--listen-addr", p.Addr,
		"--data-dir", filepath.Join(tb.TempDir(), "proxy")}, args...)
	tb.Cleanup(func() {
		if p.cmd != nil {
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			p.Kill()
		}
	})
	p.Start()
	return p
}

// Start starts the proxy again after Kill, on the same address, and waits
// until it serves a read.
func (p *Proxy) Start() {
	p.tb.Helper()
	p.cmd = exec.Command(Binary(p.tb), p.args...)
	if err := p.cmd.Start(); err != nil {
		p.tb.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{p.Addr}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		p.tb.Fatal(err)
	}
	defer cli.Close()
	deadline := time.Now().Add(Timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := cli.Get(ctx, "/etcdtest/ready")
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			p.tb.Fatalf("the gRPC proxy on %s never served a read: %v", p.Addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Kill kills the proxy (SIGKILL) and waits for its end.
func (p *Proxy) Kill() {
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
}

// Freeze stops the proxy (SIGSTOP): its connections stay open and it
// answers nothing.
func (p *Proxy) Freeze() {
	p.tb.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		p.tb.Fatal(err)
	}
}

// Thaw lets a frozen proxy go on (SIGCONT).
func (p *Proxy) Thaw() {
	p.tb.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		p.tb.Fatal(err)
	}
}

// Pid returns the proxy's process ID.
func (p *Proxy) Pid() int { return p.cmd.Process.Pid }
