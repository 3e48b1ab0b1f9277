package consultest

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/internal/testlog"
)

// Cluster is Consul as production runs it: servers (3 or 5) on loopback
// addresses of their own (127.0.0.11, .12, …; Linux routes all of 127/8 to
// lo), and a client agent on 127.0.0.1 that joins them, which kvmount
// talks to. Servers keep their data on disk, with Consul's default
// timings (raft_multiplier 5), and can be killed, frozen and restarted.
type Cluster struct {
	// Servers are the server agents; Client the client agent.
	Servers []*Node
	Client  *Node

	bin string
	tb  testing.TB
	// clientArgs are further arguments of the client agent.
	clientArgs []string
}

// Node is one consul agent process of a Cluster.
type Node struct {
	// Name is the node's name ("s1", "client"); IP its address.
	Name, IP string
	// Ports are its HTTP, server RPC, Serf LAN and Serf WAN ports.
	Ports [4]int
	// Dir is its data directory.
	Dir string

	c      *Cluster
	server bool
	mu     sync.Mutex
	cmd    *exec.Cmd
	done   chan struct{}
	logs   testlog.Buffer
}

// StartCluster starts n servers and a client agent, and waits until the
// servers have a leader and the client reaches it; every agent is killed
// when the test ends, and its logs are shown if the test failed.
func StartCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	return StartClusterWith(tb, n)
}

// StartClusterWith is StartCluster with further arguments of the client
// agent, such as "-hcl" and a setting.
func StartClusterWith(tb testing.TB, n int, clientArgs ...string) *Cluster {
	tb.Helper()
	c := &Cluster{bin: Binary(tb), tb: tb, clientArgs: clientArgs}
	var held []net.Listener
	port := func(ip string) int {
		l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			tb.Fatal(err)
		}
		held = append(held, l)
		return l.Addr().(*net.TCPAddr).Port
	}
	node := func(name, ip string, server bool) *Node {
		nd := &Node{Name: name, IP: ip, c: c, server: server, Dir: tb.TempDir()}
		for i := range nd.Ports {
			nd.Ports[i] = port(ip)
		}
		return nd
	}
	for i := range n {
		c.Servers = append(c.Servers, node(fmt.Sprintf("s%d", i+1), fmt.Sprintf("127.0.0.%d", 11+i), true))
	}
	c.Client = node("client", "127.0.0.1", false)
	for _, l := range held {
		l.Close()
	}
	tb.Cleanup(func() {
		for _, nd := range append([]*Node{c.Client}, c.Servers...) {
			nd.Kill()
			if tb.Failed() {
				tb.Logf("consul %s logs:\n%s", nd.Name, nd.logs.String())
			}
		}
	})
	for _, s := range c.Servers {
		s.Start()
	}
	c.Client.Start()
	c.WaitLeader()
	return c
}

// Addr returns the node's HTTP API "host:port".
func (n *Node) Addr() string { return net.JoinHostPort(n.IP, strconv.Itoa(n.Ports[0])) }

// RPCAddr returns a server's RPC "host:port", which client agents forward
// requests to.
func (n *Node) RPCAddr() string { return net.JoinHostPort(n.IP, strconv.Itoa(n.Ports[1])) }

// APIClient returns an API client of the node.
func (n *Node) APIClient() *api.Client {
	cl, err := api.NewClient(&api.Config{Address: n.Addr(), Scheme: "http", WaitTime: time.Second})
	if err != nil {
		panic(err)
	}
	return cl
}

// PID returns the node's process ID, 0 when it is not running.
func (n *Node) PID() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd == nil {
		return 0
	}
	return n.cmd.Process.Pid
}

// Logs returns what the node printed.
func (n *Node) Logs() string { return n.logs.String() }

// Start starts the node's agent with its data directory as it is, and
// waits until its HTTP API answers.
func (n *Node) Start() {
	tb := n.c.tb
	tb.Helper()
	var joins []string
	for _, s := range n.c.Servers {
		if s != n {
			joins = append(joins, "-retry-join", net.JoinHostPort(s.IP, strconv.Itoa(s.Ports[2])))
		}
	}
	args := []string{"agent", "-node", n.Name, "-data-dir", n.Dir,
		"-bind", n.IP, "-advertise", n.IP, "-client", n.IP,
		"-http-port", strconv.Itoa(n.Ports[0]), "-server-port", strconv.Itoa(n.Ports[1]),
		"-serf-lan-port", strconv.Itoa(n.Ports[2]), "-serf-wan-port", strconv.Itoa(n.Ports[3]),
		"-dns-port", "-1", "-grpc-port", "-1", "-grpc-tls-port", "-1", "-log-level", "warn",
		"-hcl", "disable_update_check = true"}
	if n.server {
		args = append(args, "-server", "-bootstrap-expect", strconv.Itoa(len(n.c.Servers)))
	} else {
		args = append(args, n.c.clientArgs...)
	}
	cmd := exec.Command(n.c.bin, append(args, joins...)...)
	cmd.Stdout, cmd.Stderr = &n.logs, &n.logs
	if err := cmd.Start(); err != nil {
		tb.Fatalf("consultest: %v", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	n.mu.Lock()
	n.cmd, n.done = cmd, done
	n.mu.Unlock()
	deadline := time.Now().Add(startTimeout)
	for {
		if _, err := n.APIClient().Agent().Self(); err == nil {
			return
		}
		select {
		case <-done:
			tb.Fatalf("consultest: %s exited:\n%s", n.Name, n.Logs())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			tb.Fatalf("consultest: %s does not answer after %v", n.Name, startTimeout)
		}
	}
}

// Wipe removes the node's data directory; it must not be running.
func (n *Node) Wipe() {
	n.c.tb.Helper()
	entries, err := os.ReadDir(n.Dir)
	if err != nil {
		n.c.tb.Fatal(err)
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(n.Dir, e.Name())); err != nil {
			n.c.tb.Fatal(err)
		}
	}
}

// Kill kills the node's agent (SIGKILL) and waits for it to exit.
func (n *Node) Kill() {
	n.mu.Lock()
	cmd, done := n.cmd, n.done
	n.cmd = nil
	n.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGCONT)
	_ = cmd.Process.Kill()
	<-done
}

// Freeze stops the node's agent (SIGSTOP); Thaw lets it run again.
func (n *Node) Freeze() { n.signal(syscall.SIGSTOP) }

// Thaw lets a frozen node run again (SIGCONT).
func (n *Node) Thaw() { n.signal(syscall.SIGCONT) }

func (n *Node) signal(sig syscall.Signal) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.cmd != nil {
		_ = n.cmd.Process.Signal(sig)
	}
}

// Leader returns the server that leads, asking each running server
// (status/leader); nil when none knows one.
func (c *Cluster) Leader() *Node {
	for _, s := range c.Servers {
		if s.PID() == 0 {
			continue
		}
		addr, err := s.APIClient().Status().Leader()
		if err != nil || addr == "" {
			continue
		}
		for _, l := range c.Servers {
			if addr == l.RPCAddr() {
				return l
			}
		}
	}
	return nil
}

// WaitLeader waits until the servers have a leader that accepts writes
// through the client agent, and returns it.
func (c *Cluster) WaitLeader() *Node {
	c.tb.Helper()
	deadline := time.Now().Add(startTimeout)
	for {
		if l := c.Leader(); l != nil {
			if _, err := c.Client.APIClient().KV().Put(&api.KVPair{Key: "kvmount-test/ready", Value: []byte("1")}, nil); err == nil {
				return l
			}
		}
		if time.Now().After(deadline) {
			c.tb.Fatalf("consultest: no leader after %v", startTimeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Forwarding returns the servers the client agent holds an RPC
// connection to — the one it forwards requests to, and any it used
// before — found in /proc: the agent's sockets whose peer is a server's
// RPC port.
func (c *Cluster) Forwarding() []*Node {
	c.tb.Helper()
	pid := c.Client.PID()
	inodes := map[string]bool{}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		c.tb.Fatal(err)
	}
	for _, fd := range fds {
		target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err == nil && strings.HasPrefix(target, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(target, "socket:["), "]")] = true
		}
	}
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		c.tb.Fatal(err)
	}
	var out []*Node
	for _, line := range strings.Split(string(data), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 10 || f[3] != "01" || !inodes[f[9]] { // 01: ESTABLISHED
			continue
		}
		for _, s := range c.Servers {
			if f[2] == hexAddr(s.IP, s.Ports[1]) && !slices.Contains(out, s) {
				out = append(out, s)
			}
		}
	}
	return out
}

// hexAddr returns ip:port as /proc/net/tcp writes it (little-endian IPv4,
// big-endian port, in hex).
func hexAddr(ip string, port int) string {
	v4 := net.ParseIP(ip).To4()
	return fmt.Sprintf("%02X%02X%02X%02X:%04X", v4[3], v4[2], v4[1], v4[0], port)
}
