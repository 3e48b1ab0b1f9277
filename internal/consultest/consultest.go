// Package consultest runs a real Consul agent (consul agent -dev) on
// loopback ports for tests, and writes keys to it in transactions.
package consultest

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/internal/testbin"
	"github.com/kvmount/kvmount/internal/testlog"
)

// startTimeout bounds how long an agent may take to elect itself leader.
const startTimeout = 60 * time.Second

// Delete, as a value to Txn, deletes the key.
const Delete = "<delete>"

// Binary returns the consul binary tests run: $KVMOUNT_CONSUL, else consul
// on $PATH, else the build that scripts/consul-agent.sh caches. When there
// is none the test is skipped — or fails when CI=true, where a missing
// agent must never pass unnoticed.
func Binary(tb testing.TB) string {
	tb.Helper()
	b := testbin.Binary{What: "Consul agent", Env: "KVMOUNT_CONSUL", Dir: "consul-v1.20.1", Name: "consul", Script: "scripts/consul-agent.sh"}
	if os.Getenv(b.Env) == "" {
		if bin, err := exec.LookPath("consul"); err == nil {
			return bin
		}
	}
	return b.Find(tb)
}

// Agent is one consul agent -dev process with fixed ports, so that it can
// be stopped and started again at the same address. A -dev agent keeps its
// data in memory: a restart starts empty, with indexes reset.
type Agent struct {
	bin   string
	ports [4]int // http, server, serf lan, serf wan
	args  []string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	logs testlog.Buffer
}

// Start starts an agent and waits until it is leader; it is stopped when
// the test ends, and its logs are shown if the test failed. args are added
// to the agent's command line, such as "-hcl" and a configuration snippet.
//
// A port found free can be taken by another process (another test binary)
// before the agent binds it; Start then tries other ports, up to five
// times.
func Start(tb testing.TB, args ...string) *Agent {
	tb.Helper()
	bin := Binary(tb)
	var a *Agent
	for attempt := 1; ; attempt++ {
		a = &Agent{bin: bin, args: args}
		if err := freePorts(a.ports[:]); err != nil {
			tb.Fatal(err)
		}
		err := a.Restart()
		if err == nil {
			break
		}
		if attempt == 5 || !strings.Contains(a.Logs(), "address already in use") {
			tb.Fatal(err)
		}
	}
	tb.Cleanup(func() {
		a.Stop()
		if tb.Failed() {
			tb.Logf("consul agent logs:\n%s", a.Logs())
		}
	})
	return a
}

// Addr returns the HTTP API's "host:port".
func (a *Agent) Addr() string { return "127.0.0.1:" + strconv.Itoa(a.ports[0]) }

// URL returns the HTTP API's URL.
func (a *Agent) URL() string { return "http://" + a.Addr() }

// PID returns the agent's process ID; 0 when it is stopped.
func (a *Agent) PID() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd == nil {
		return 0
	}
	return a.cmd.Process.Pid
}

// Logs returns what the agent printed.
func (a *Agent) Logs() string { return a.logs.String() }

// Restart starts the agent after Stop (or for the first time) and waits
// until it has elected itself leader.
func (a *Agent) Restart() error {
	cmd := exec.Command(a.bin, "agent", "-dev",
		"-bind", "127.0.0.1", "-client", "127.0.0.1",
		"-http-port", strconv.Itoa(a.ports[0]),
		"-server-port", strconv.Itoa(a.ports[1]),
		"-serf-lan-port", strconv.Itoa(a.ports[2]),
		"-serf-wan-port", strconv.Itoa(a.ports[3]),
		"-dns-port", "-1", "-grpc-port", "-1", "-grpc-tls-port", "-1",
		"-log-level", "warn",
	)
	cmd.Args = append(cmd.Args, a.args...)
	cmd.Stdout, cmd.Stderr = &a.logs, &a.logs
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("consultest: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	a.mu.Lock()
	a.cmd, a.done = cmd, done
	a.mu.Unlock()
	client := a.Client()
	deadline := time.Now().Add(startTimeout)
	for {
		leader, err := client.Status().Leader()
		if err == nil && leader != "" {
			// Leader elected; wait for KV writes to be accepted too.
			if _, err := client.KV().Put(&api.KVPair{Key: "kvmount-test/ready", Value: []byte("1")}, nil); err == nil {
				_, _ = client.KV().Delete("kvmount-test/ready", nil)
				return nil
			}
		}
		select {
		case <-done:
			return fmt.Errorf("consultest: agent exited:\n%s", a.Logs())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			a.Stop()
			return fmt.Errorf("consultest: no leader after %v:\n%s", startTimeout, a.Logs())
		}
	}
}

// Stop kills the agent and waits for it to exit.
func (a *Agent) Stop() {
	a.mu.Lock()
	cmd, done := a.cmd, a.done
	a.cmd = nil
	a.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// Client returns an API client of the agent.
func (a *Agent) Client() *api.Client {
	c, err := api.NewClient(&api.Config{Address: a.Addr(), Scheme: "http"})
	if err != nil {
		panic(err) // only for a malformed address, which Addr never makes
	}
	return c
}

// maxTxnOps is how many operations Consul accepts in one transaction.
const maxTxnOps = 64

// Txn writes key/value pairs in transactions of up to 64 operations each —
// one transaction when there are few; a value of Delete deletes its key.
// Keys go in the request body, so names such as "a/../b" stay as they are.
func Txn(tb testing.TB, client *api.Client, kv ...string) {
	tb.Helper()
	var ops api.KVTxnOps
	flush := func() {
		if len(ops) == 0 {
			return
		}
		ok, resp, _, err := client.KV().Txn(ops, nil)
		if err != nil || !ok {
			tb.Fatalf("consul txn: ok=%v err=%v errors=%v", ok, err, resp)
		}
		ops = nil
	}
	for i := 0; i+1 < len(kv); i += 2 {
		op := &api.KVTxnOp{Verb: api.KVSet, Key: kv[i], Value: []byte(kv[i+1])}
		if kv[i+1] == Delete {
			op = &api.KVTxnOp{Verb: api.KVDelete, Key: kv[i]}
		}
		ops = append(ops, op)
		if len(ops) == maxTxnOps {
			flush()
		}
	}
	flush()
}

// freePorts fills ports with distinct free loopback TCP ports. Each
// listener stays open until all are chosen: closed one by one, the kernel
// may hand the same port out twice (an agent given one port for HTTP and
// Serf refuses to start).
func freePorts(ports []int) error {
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return fmt.Errorf("consultest: %w", err)
		}
		defer l.Close()
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return nil
}
