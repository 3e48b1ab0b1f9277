// Package embedetcd runs a real, single-member etcd server in-process
// (go.etcd.io/etcd/server/v3/embed) on loopback ports, for kvmount's tests,
// benchmarks and demo. It is never linked into the daemon.
package embedetcd

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// startTimeout bounds how long a start waits for the member to serve.
const startTimeout = 30 * time.Second

// Options tune a Server.
type Options struct {
	// Fsync keeps etcd's fsyncs. Off, writes are faster and a crash of the
	// test machine may lose them, which tests do not mind.
	Fsync bool
}

// Server is one in-process etcd member with its data directory and ports
// fixed, so that it can be stopped and started again as the same member.
type Server struct {
	dir       string
	clientURL url.URL
	peerURL   url.URL
	opts      Options
	etcd      *embed.Etcd
}

// startAttempts is how many pairs of free ports Start tries.
const startAttempts = 5

// Start starts a member with its data in dir (created if needed) on free
// loopback ports, and waits until it serves. A port found free can be
// taken by another process (another test binary) before etcd binds it;
// Start then tries other ports, up to startAttempts times.
func Start(dir string, opts Options) (*Server, error) {
	_, statErr := os.Stat(dir)
	fresh := errors.Is(statErr, os.ErrNotExist)
	var err error
	for range startAttempts {
		var client, peer url.URL
		if client, err = pickURL(); err != nil {
			return nil, err
		}
		if peer, err = pickURL(); err != nil {
			return nil, err
		}
		s := &Server{dir: dir, clientURL: client, peerURL: peer, opts: opts}
		if err = s.Restart(); err == nil {
			return s, nil
		}
		if !errors.Is(err, syscall.EADDRINUSE) && !strings.Contains(err.Error(), "address already in use") {
			return nil, err
		}
		if fresh {
			_ = os.RemoveAll(dir) // what the failed start left, naming the old ports
		}
	}
	return nil, err
}

// Endpoint returns the client URL, such as "http://127.0.0.1:41234".
func (s *Server) Endpoint() string { return s.clientURL.String() }

// Restart starts the member again after Stop, with the same data and ports.
func (s *Server) Restart() error {
	if s.etcd != nil {
		return errors.New("embedetcd: already running")
	}
	cfg := embed.NewConfig()
	cfg.Name = "kvmount-test"
	cfg.Dir = s.dir
	cfg.ListenClientUrls = []url.URL{s.clientURL}
	cfg.AdvertiseClientUrls = []url.URL{s.clientURL}
	cfg.ListenPeerUrls = []url.URL{s.peerURL}
	cfg.AdvertisePeerUrls = []url.URL{s.peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.UnsafeNoFsync = !s.opts.Fsync
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	cfg.LogLevel = "error"
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return fmt.Errorf("embedetcd: start: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return fmt.Errorf("embedetcd: start: %w", err)
	case <-time.After(startTimeout):
		e.Close()
		return fmt.Errorf("embedetcd: not ready after %v", startTimeout)
	}
	s.etcd = e
	return nil
}

// Stop stops the member; its data stays for Restart.
func (s *Server) Stop() {
	if s.etcd != nil {
		s.etcd.Close()
		s.etcd = nil
	}
}

// Wipe removes the member's data directory, as a disk loss would; the
// member must be stopped. The next Restart starts an empty store, at
// revision 1, on the same ports.
func (s *Server) Wipe() error {
	if s.etcd != nil {
		return errors.New("embedetcd: wipe a running member")
	}
	if err := os.RemoveAll(s.dir); err != nil {
		return fmt.Errorf("embedetcd: %w", err)
	}
	return nil
}

// Client returns a new client of the member; the caller closes it.
func (s *Server) Client() (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{
		Endpoints:   []string{s.Endpoint()},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
}

// pickURL is freeURL; a test replaces it to hand out a port in use.
var pickURL = freeURL

// freeURL returns an http URL on a loopback port that was free a moment ago.
func freeURL() (url.URL, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return url.URL{}, fmt.Errorf("embedetcd: %w", err)
	}
	defer l.Close()
	return url.URL{Scheme: "http", Host: l.Addr().String()}, nil
}
