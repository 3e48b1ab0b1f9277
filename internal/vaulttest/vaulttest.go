// Package vaulttest runs a real Vault server (vault server -dev, in memory,
// built from the Go module proxy by scripts/vault-server.sh) on loopback
// ports for tests.
package vaulttest

import (
	"context"
	"fmt"
	"net"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/kvmount/kvmount/internal/testbin"
	"github.com/kvmount/kvmount/internal/testlog"
)

// Version is the Vault release scripts/vault-server.sh builds.
const Version = "v1.16.3"

// RootToken is the dev server's root token (a dev root token id may not
// start with "s.").
const RootToken = "kvmount-test-root"

// startTimeout bounds how long a server may take to be unsealed and active.
const startTimeout = 60 * time.Second

// Binary returns the vault binary tests run: $KVMOUNT_VAULT, else the
// build scripts/vault-server.sh caches. When there is none the test is
// skipped — or fails when CI=true, where a missing server must never pass
// unnoticed.
func Binary(tb testing.TB) string {
	tb.Helper()
	return testbin.Binary{What: "Vault server", Env: "KVMOUNT_VAULT", Dir: "vault-" + Version, Name: "vault", Script: "scripts/vault-server.sh"}.Find(tb)
}

// Server is one vault server -dev process on a fixed port, so that it can
// be stopped and started again at the same address. It keeps its data in
// memory: a restart starts empty.
type Server struct {
	bin  string
	port int
	home string
	// tls serves https with a CA of the server's own (-dev-tls), whose
	// files are in home.
	tls bool

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
	logs testlog.Buffer
}

// Start starts a server and waits until it is unsealed and active; it is
// stopped when the test ends, and its logs are shown if the test failed. A
// port found free can be taken before the server binds it (the dev server
// also takes the next one for its cluster listener); Start then tries
// other ports, up to five times.
func Start(tb testing.TB) *Server {
	tb.Helper()
	return start(tb, false)
}

// StartTLS is Start for a server that serves https (vault server -dev
// -dev-tls), with a certificate for 127.0.0.1 from a CA of its own, whose
// file CAFile returns.
func StartTLS(tb testing.TB) *Server {
	tb.Helper()
	return start(tb, true)
}

func start(tb testing.TB, tls bool) *Server {
	tb.Helper()
	bin := Binary(tb)
	var s *Server
	for attempt := 1; ; attempt++ {
		port, err := freePair()
		if err != nil {
			tb.Fatal(err)
		}
		s = &Server{bin: bin, port: port, home: tb.TempDir(), tls: tls}
		err = s.Restart()
		if err == nil {
			break
		}
		if attempt == 5 || !strings.Contains(s.Logs(), "address already in use") {
			tb.Fatal(err)
		}
	}
	tb.Cleanup(func() {
		s.Stop()
		if tb.Failed() {
			tb.Logf("vault server logs:\n%s", s.Logs())
		}
	})
	return s
}

// Addr returns the API's "host:port".
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// URL returns the API's URL.
func (s *Server) URL() string {
	if s.tls {
		return "https://" + s.Addr()
	}
	return "http://" + s.Addr()
}

// CAFile returns the file of the CA a StartTLS server's certificate is
// from; "" for a server of Start.
func (s *Server) CAFile() string {
	if !s.tls {
		return ""
	}
	return filepath.Join(s.home, "vault-ca.pem")
}

// Logs returns what the server printed.
func (s *Server) Logs() string { return s.logs.String() }

// Restart starts the server after Stop (or for the first time), empty, and
// waits until it is active.
func (s *Server) Restart() error {
	cmd := exec.Command(s.bin, "server", "-dev",
		"-dev-root-token-id="+RootToken,
		"-dev-listen-address="+s.Addr(),
		"-dev-no-store-token",
		"-log-level=warn",
	)
	if s.tls {
		cmd.Args = append(cmd.Args, "-dev-tls", "-dev-tls-cert-dir="+s.home)
	}
	// No VAULT_* of the test's environment, and a home of its own.
	cmd.Env = []string{"HOME=" + s.home, "PATH=/usr/bin:/bin"}
	cmd.Stdout, cmd.Stderr = &s.logs, &s.logs
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("vaulttest: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	var client *api.Client
	deadline := time.Now().Add(startTimeout)
	for {
		if client == nil {
			client, _ = s.newClient() // a -dev-tls server writes its CA first
		}
		if client != nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			h, err := client.Sys().HealthWithContext(ctx)
			cancel()
			if err == nil && h.Initialized && !h.Sealed && !h.Standby {
				return nil
			}
		}
		select {
		case <-done:
			return fmt.Errorf("vaulttest: server exited:\n%s", s.Logs())
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.Stop()
			return fmt.Errorf("vaulttest: not active after %v:\n%s", startTimeout, s.Logs())
		}
	}
}

// Stop kills the server and waits for it to exit.
func (s *Server) Stop() {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = cmd.Process.Kill()
	<-done
}

// Client returns an API client of the server with the root token, made
// from nothing of the environment.
func (s *Server) Client(tb testing.TB) *api.Client {
	tb.Helper()
	return s.client()
}

func (s *Server) client() *api.Client {
	c, err := s.newClient()
	if err != nil {
		panic(err) // the server is up: its address and CA are sound
	}
	return c
}

// newClient returns a client with the root token, trusting the server's
// CA when it has one.
func (s *Server) newClient() (*api.Client, error) {
	cfg := &api.Config{Address: s.URL(), Timeout: 10 * time.Second}
	if s.tls {
		if err := cfg.ConfigureTLS(&api.TLSConfig{CACert: s.CAFile()}); err != nil {
			return nil, err
		}
	}
	c, err := api.NewClient(cfg)
	if err != nil {
		return nil, err
	}
	c.SetToken(RootToken)
	c.ClearNamespace()
	return c, nil
}

// Write writes data at path (a PUT), failing the test on error, and
// returns the response.
func (s *Server) Write(tb testing.TB, path string, data map[string]any) *api.Secret {
	tb.Helper()
	secret, err := s.client().Logical().WriteWithContext(context.Background(), path, data)
	if err != nil {
		tb.Fatalf("vaulttest: write %s: %v", path, err)
	}
	return secret
}

// Put writes a KV v2 secret's fields at path in the engine mounted at
// mount ("secret"), failing the test on error.
func (s *Server) Put(tb testing.TB, mount, path string, fields map[string]any) {
	tb.Helper()
	if _, err := s.client().KVv2(mount).Put(context.Background(), path, fields); err != nil {
		tb.Fatalf("vaulttest: put %s/%s: %v", mount, path, err)
	}
}

// freePair returns a free loopback port whose successor was free too.
func freePair() (int, error) {
	for range 20 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("vaulttest: %w", err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		next, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+1))
		l.Close()
		if err == nil {
			next.Close()
			return port, nil
		}
	}
	return 0, fmt.Errorf("vaulttest: no two free consecutive ports")
}
