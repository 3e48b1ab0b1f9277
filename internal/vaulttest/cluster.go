package vaulttest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/kvmount/kvmount/internal/testlog"
)

// Cluster is a Vault HA cluster as operators run it: n nodes with
// integrated storage (Raft), each on a loopback address of its own
// (127.0.0.11, .12, …; Linux routes all of 127/8 to lo), initialised with
// one key share, joined and unsealed. Its nodes can be killed, frozen,
// sealed, restarted and stepped down.
type Cluster struct {
	// Nodes are the cluster's nodes, the first the one it was initialised
	// on.
	Nodes []*Node
	// UnsealKey and RootToken are what the initialisation gave.
	UnsealKey, RootToken string

	bin string
	tb  testing.TB
}

// Node is one vault server process of a Cluster.
type Node struct {
	// ID is the node's Raft node_id ("n1").
	ID string
	// IP is its loopback address; APIPort and ClusterPort its ports.
	IP                   string
	APIPort, ClusterPort int

	c    *Cluster
	dir  string
	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	logs testlog.Buffer
}

// Health states of a node, as GET /v1/sys/health answers them.
const (
	HealthActive  = http.StatusOK
	HealthStandby = http.StatusTooManyRequests
	HealthSealed  = http.StatusServiceUnavailable
)

// StartCluster starts an HA cluster of n nodes and waits until one is
// active and every other is an unsealed standby; the nodes are killed
// when the test ends, and their logs shown if it failed.
func StartCluster(tb testing.TB, n int) *Cluster {
	tb.Helper()
	c := &Cluster{bin: Binary(tb), tb: tb}
	ports, err := freeAddrs(n)
	if err != nil {
		tb.Fatal(err)
	}
	for i := range n {
		node := &Node{ID: fmt.Sprintf("n%d", i+1), IP: ports[i].ip, APIPort: ports[i].api, ClusterPort: ports[i].cluster,
			c: c, dir: tb.TempDir()}
		if err := node.writeConfig(); err != nil {
			tb.Fatal(err)
		}
		c.Nodes = append(c.Nodes, node)
	}
	tb.Cleanup(func() {
		for _, node := range c.Nodes {
			node.Kill()
			if tb.Failed() {
				tb.Logf("vault node %s logs:\n%s", node.ID, node.logs.String())
			}
		}
	})
	first := c.Nodes[0]
	first.Start()
	init, err := first.sys("").InitWithContext(context.Background(), &api.InitRequest{SecretShares: 1, SecretThreshold: 1})
	if err != nil {
		tb.Fatalf("vaulttest: init: %v", err)
	}
	if len(init.KeysB64) != 1 || init.RootToken == "" {
		tb.Fatalf("vaulttest: init gave %d keys", len(init.KeysB64))
	}
	c.UnsealKey, c.RootToken = init.KeysB64[0], init.RootToken
	first.Unseal()
	first.WaitHealth(HealthActive)
	// Autopilot makes a joined node a voter once it has been healthy for
	// server_stabilization_time (10 s by default): 1 s here.
	if _, err := c.Client(first).Logical().Write("sys/storage/raft/autopilot/configuration", map[string]any{"server_stabilization_time": "1s"}); err != nil {
		tb.Fatalf("vaulttest: autopilot configuration: %v", err)
	}
	for _, node := range c.Nodes[1:] {
		node.Start()
		if _, err := node.sys("").RaftJoinWithContext(context.Background(), &api.RaftJoinRequest{LeaderAPIAddr: first.URL()}); err != nil {
			tb.Fatalf("vaulttest: node %s: raft join: %v", node.ID, err)
		}
		node.Unseal()
		node.WaitHealth(HealthStandby)
	}
	c.waitVoters(n)
	return c
}

// waitVoters waits until the Raft configuration has n voters, so that
// the cluster survives the loss of a node.
func (c *Cluster) waitVoters(n int) {
	c.tb.Helper()
	deadline := time.Now().Add(startTimeout)
	for {
		voters := 0
		if s, err := c.Client(c.Active()).Logical().Read("sys/storage/raft/configuration"); err == nil && s != nil {
			cfg, _ := s.Data["config"].(map[string]any)
			servers, _ := cfg["servers"].([]any)
			for _, srv := range servers {
				if m, _ := srv.(map[string]any); m["voter"] == true {
					voters++
				}
			}
		}
		if voters == n {
			return
		}
		if time.Now().After(deadline) {
			c.tb.Fatalf("vaulttest: %d voters after %v; want %d", voters, startTimeout, n)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// addrs are one node's address and ports.
type addrs struct {
	ip           string
	api, cluster int
}

// freeAddrs returns n loopback addresses from 127.0.0.11 on, each with two
// free ports, found with every listener held open so that none is handed
// out twice.
func freeAddrs(n int) ([]addrs, error) {
	var held []net.Listener
	defer func() {
		for _, l := range held {
			l.Close()
		}
	}()
	port := func(ip string) (int, error) {
		l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
		if err != nil {
			return 0, fmt.Errorf("vaulttest: %w", err)
		}
		held = append(held, l)
		return l.Addr().(*net.TCPAddr).Port, nil
	}
	var out []addrs
	for i := range n {
		a := addrs{ip: fmt.Sprintf("127.0.0.%d", 11+i)}
		var err error
		if a.api, err = port(a.ip); err != nil {
			return nil, err
		}
		if a.cluster, err = port(a.ip); err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}

// Client returns an API client of the cluster's node with the root token.
func (c *Cluster) Client(node *Node) *api.Client {
	cl, err := api.NewClient(&api.Config{Address: node.URL(), Timeout: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	cl.SetToken(c.RootToken)
	cl.ClearNamespace()
	return cl
}

// Active waits until a node answers that it is active and returns it.
func (c *Cluster) Active() *Node {
	c.tb.Helper()
	deadline := time.Now().Add(startTimeout)
	for {
		for _, node := range c.Nodes {
			if node.Health() == HealthActive {
				return node
			}
		}
		if time.Now().After(deadline) {
			c.tb.Fatalf("vaulttest: no active node after %v", startTimeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Addr returns the node's API "host:port".
func (n *Node) Addr() string { return net.JoinHostPort(n.IP, strconv.Itoa(n.APIPort)) }

// URL returns the node's API URL.
func (n *Node) URL() string { return "http://" + n.Addr() }

// Logs returns what the node printed.
func (n *Node) Logs() string { return n.logs.String() }

func (n *Node) writeConfig() error {
	hcl := fmt.Sprintf(`storage "raft" {
  path = %q
  node_id = %q
  performance_multiplier = 1
}
listener "tcp" {
  address = %q
  cluster_address = %q
  tls_disable = true
}
api_addr = %q
cluster_addr = %q
disable_mlock = true
ui = false
log_level = "warn"
`, filepath.Join(n.dir, "raft"), n.ID, n.Addr(), net.JoinHostPort(n.IP, strconv.Itoa(n.ClusterPort)),
		n.URL(), "https://"+net.JoinHostPort(n.IP, strconv.Itoa(n.ClusterPort)))
	if err := os.MkdirAll(filepath.Join(n.dir, "raft"), 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(n.dir, "vault.hcl"), []byte(hcl), 0o600)
}

// Start starts the node's process, sealed, and waits until its API
// answers.
func (n *Node) Start() {
	tb := n.c.tb
	tb.Helper()
	cmd := exec.Command(n.c.bin, "server", "-config="+filepath.Join(n.dir, "vault.hcl"))
	cmd.Env = []string{"HOME=" + n.dir, "PATH=/usr/bin:/bin"}
	cmd.Stdout, cmd.Stderr = &n.logs, &n.logs
	if err := cmd.Start(); err != nil {
		tb.Fatalf("vaulttest: %v", err)
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
	for n.Health() == 0 {
		select {
		case <-done:
			tb.Fatalf("vaulttest: node %s exited:\n%s", n.ID, n.Logs())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			tb.Fatalf("vaulttest: node %s does not answer after %v", n.ID, startTimeout)
		}
	}
}

// Unseal unseals the node with the cluster's key.
func (n *Node) Unseal() {
	n.c.tb.Helper()
	if _, err := n.sys("").UnsealWithContext(context.Background(), n.c.UnsealKey); err != nil {
		n.c.tb.Fatalf("vaulttest: node %s: unseal: %v", n.ID, err)
	}
}

// Restart starts the node after Kill, unseals it, and waits until it is
// active or a standby.
func (n *Node) Restart() {
	n.c.tb.Helper()
	n.Start()
	n.Unseal()
	n.WaitHealth(HealthActive, HealthStandby)
}

// Seal seals the node: the active node through sys/seal; a standby, which
// Vault does not seal ("vault cannot seal when in standby mode; please
// restart instead"), by a restart left sealed. A node whose health said
// active but that was a standby by the time of the seal (its role moved
// in between, as after a node frozen and thawed) is sealed as a standby.
func (n *Node) Seal() {
	n.c.tb.Helper()
	sealed := false
	if n.Health() == HealthActive {
		err := n.sys(n.c.RootToken).SealWithContext(context.Background())
		if err != nil && !strings.Contains(err.Error(), errStandbySeal) {
			n.c.tb.Fatalf("vaulttest: node %s: seal: %v", n.ID, err)
		}
		sealed = err == nil
	}
	if !sealed {
		n.Kill()
		n.Start()
	}
	n.WaitHealth(HealthSealed)
}

// errStandbySeal is what Vault answers a seal of a standby with.
const errStandbySeal = "vault cannot seal when in standby mode"

// StepDown asks the node, the active one, to give up its role.
func (n *Node) StepDown() {
	n.c.tb.Helper()
	if err := n.sys(n.c.RootToken).StepDownWithContext(context.Background()); err != nil {
		n.c.tb.Fatalf("vaulttest: node %s: step-down: %v", n.ID, err)
	}
}

// Kill kills the node's process (SIGKILL) and waits for it to exit.
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

// Freeze stops the node's process (SIGSTOP): its sockets accept
// connections, and nothing answers.
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

// Health returns the status of the node's GET /v1/sys/health (HealthActive,
// HealthStandby, HealthSealed, 501 before its initialisation), 0 when it
// does not answer within a second.
func (n *Node) Health() int {
	cl := http.Client{Timeout: time.Second}
	resp, err := cl.Get(n.URL() + "/v1/sys/health")
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// WaitHealth waits until the node's health is one of want.
func (n *Node) WaitHealth(want ...int) {
	n.c.tb.Helper()
	deadline := time.Now().Add(startTimeout)
	for {
		got := n.Health()
		for _, w := range want {
			if got == w {
				return
			}
		}
		if time.Now().After(deadline) {
			n.c.tb.Fatalf("vaulttest: node %s health %d after %v; want %v\n%s", n.ID, got, startTimeout, want, n.Logs())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// sys returns the node's sys API with token.
func (n *Node) sys(token string) *api.Sys {
	cl := n.c.Client(n)
	cl.SetToken(token)
	return cl.Sys()
}
