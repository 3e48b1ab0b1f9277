package etcd

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"sync/atomic"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"

	"github.com/kvmount/kvmount/peercred"
	"github.com/kvmount/kvmount/source"
)

// connect returns the shared client and the monitor of its connection,
// creating them on first use. With a username, creating the client
// authenticates, which needs etcd up.
func (s *Source) connect() (*clientv3.Client, *monitor, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client != nil {
		return s.client, s.monitor, nil
	}
	cc := clientv3.Config{
		Endpoints:            s.cfg.Endpoints,
		DialTimeout:          s.cfg.DialTimeout,
		DialKeepAliveTime:    keepAliveTime,
		DialKeepAliveTimeout: keepAliveTimeout,
		Username:             s.cfg.Username,
		Password:             s.cfg.Password.Reveal(),
		Logger:               zap.NewNop(),
		MaxCallRecvMsgSize:   maxRecvMsgSize,
		// Reconnect after an outage on kvmount's retry schedule rather
		// than gRPC's default, which backs off to two minutes.
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: grpcbackoff.Config{
				BaseDelay:  source.RetryMin,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   source.RetryMax,
			},
			MinConnectTimeout: s.cfg.DialTimeout,
		}),
			grpc.WithInitialWindowSize(streamWindow),
			grpc.WithInitialConnWindowSize(connWindow),
		},
	}
	if s.cfg.PeerUID >= 0 {
		cc.DialOptions = append(cc.DialOptions, grpc.WithContextDialer(peerDialer(s.cfg.PeerUID, &s.refused)))
	}
	if s.cfg.TLS.Enabled() {
		tc, err := s.cfg.TLS.Config()
		if err != nil {
			return nil, nil, fmt.Errorf("source/etcd: %w", err)
		}
		cc.TLS = tc
	} else if usesTLS(s.cfg.Endpoints) {
		cc.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	cli, err := clientv3.New(cc)
	if err != nil {
		return nil, nil, fmt.Errorf("source/etcd: connect %s: %w", strings.Join(s.cfg.Endpoints, ","), err)
	}
	s.client, s.monitor = cli, startMonitor(cli, s.cfg.Endpoints, s.log)
	return cli, s.monitor, nil
}

// peerDialer returns a dialer of etcd endpoints — "unix:" or "unix://"
// paths, host:port on TCP — that hands on only connections whose other
// end runs as uid (peercred.Check), and keeps the last refusal in refused
// (nil after a connection passes).
func peerDialer(uid int, refused *atomic.Pointer[error]) func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		network, address := "tcp", addr
		if rest, ok := strings.CutPrefix(addr, "unix:"); ok {
			network, address = "unix", strings.TrimPrefix(rest, "//")
		}
		var d net.Dialer
		c, err := d.DialContext(ctx, network, address)
		if err != nil {
			return nil, err
		}
		if err := peercred.Check(c, uid); err != nil {
			c.Close()
			err = fmt.Errorf("%s: %w", addr, err)
			refused.Store(&err)
			return nil, err
		}
		refused.Store(nil)
		return c, nil
	}
}

func usesTLS(endpoints []string) bool {
	for _, ep := range endpoints {
		if strings.HasPrefix(ep, "https://") || strings.HasPrefix(ep, "unixs://") {
			return true
		}
	}
	return false
}

// streamWindow and connWindow are the HTTP/2 flow-control windows of the
// client's connection (RFC 9113, section 5.2), per stream and for the
// whole connection, in bytes. Set, they turn off gRPC's dynamic window:
// its estimator of the bandwidth-delay product answers the first data
// frame after each of its pings with a window update and a new PING
// (grpc-go's bdpEstimator), so every watch event cost a write to etcd,
// etcd's answer, and a wake-up of etcd and of the worker, on the path of
// the event to the monitor. The sizes are within what that estimator
// grows both windows to on a fast link (16 MiB at most), so that no more
// is buffered for a slow reader than before; a page of a read, up to
// maxRecvMsgSize, flows in 4 MiB round trips rather than the 64 KiB of
// HTTP/2's default.
const (
	streamWindow = 4 << 20
	connWindow   = 16 << 20
)
