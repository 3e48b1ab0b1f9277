package etcd

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/metadata"
)

// monitor watches the connection of a Source's client, and the progress of
// the watches on it (stall.go), on behalf of all the watches that use it —
// two goroutines per client, not per prefix: with a thousand prefixes, a
// thousand goroutines and their stacks waiting for the same state change.
//
// It reports each watch's prefix stale while the connection is in
// transient failure, and current again once it is ready: a watch
// reconnects silently and resumes where it left off, so without this an
// etcd outage would go unreported. Each time the connection becomes ready
// again it reads one key and hands the response header to every watch, so
// that an etcd that came back with less data is noticed at once rather
// than at the next progress notification (every 10 minutes by default).
type monitor struct {
	cli          *clientv3.Client
	endpoints    string
	endpointList []string
	log          *slog.Logger
	cancel       context.CancelFunc
	done         chan struct{}

	mu    sync.Mutex
	state connectivity.State
	subs  map[*subscriber]struct{}

	// avoided are the cancels of the probes of endpoints left out of the
	// client's endpoints after a stall (stall.go).
	avoidMu sync.Mutex
	avoided []context.CancelFunc
	// progressRequests counts the progress requests sent, and
	// statusProbes the rounds of status probes that an unanswered one
	// led to, for tests and benchmarks.
	progressRequests atomic.Int64
	statusProbes     atomic.Int64
	// stream numbers the gRPC watch stream new watches go on
	// (watchContext). It grows when a stall starts the silent watches
	// again (checkStall), so that they go on a stream of their own, to a
	// member the client still uses, rather than back on the stalled one.
	stream atomic.Uint64
}

// streamMetadataKey is the gRPC metadata that sets a watch's stream apart:
// clientv3 puts the watches whose contexts carry the same outgoing
// metadata on one stream (streamKeyFromCtx), and sends a progress request
// on the stream its context's metadata names.
const streamMetadataKey = "kvmount-watch-stream"

// streamContext returns ctx for a watch, or a progress request, on the
// stream numbered stream: with WithRequireLeader, so that a member that
// lost its leader ends the watch.
func streamContext(ctx context.Context, stream uint64) context.Context {
	return clientv3.WithRequireLeader(metadata.AppendToOutgoingContext(ctx, streamMetadataKey, strconv.FormatUint(stream, 10)))
}

// watchContext returns ctx for a new watch, on the stream new watches go
// on, and that stream's number (for subscribe).
func (m *monitor) watchContext(ctx context.Context) (context.Context, uint64) {
	n := m.stream.Load()
	return streamContext(ctx, n), n
}

// statusReporter is what a subscriber reports the connection's state and
// its stalls to: the prefixes of its watch (a group, group.go).
type statusReporter interface {
	Status(err error)
}

// subscriber is one watch's interest in the connection.
type subscriber struct {
	// prefix is read by the probe after a reconnect: one its user may
	// read.
	prefix string
	pub    statusReporter
	// stream is the number of the gRPC stream the watch is on
	// (watchContext): progress is asked on it.
	stream uint64
	// probes receives the header of the read made after each reconnect;
	// it holds one, the newest.
	probes chan *etcdserverpb.ResponseHeader
	// heardAt is when the watch last received anything (Unix ns), and
	// member the member ID in that response's header.
	heardAt atomic.Int64
	member  atomic.Uint64
	// stalledErr is set while the watch is reported stalled; stall
	// tells the watch to start again, on a new stream.
	stalledErr atomic.Bool
	stall      chan error
	// unconfirmed is set for a watch that resumes one that ended until
	// it hears from a member (hear): the connection's state does not
	// report it current meanwhile.
	unconfirmed atomic.Bool
}

// heard returns when the watch last received anything.
func (s *subscriber) heard() time.Time { return time.Unix(0, s.heardAt.Load()) }

// hear records a response from member; it returns true when the watch had
// been reported stalled, and is current again.
func (s *subscriber) hear(member uint64) bool {
	s.touch(member)
	s.unconfirmed.Store(false)
	return s.stalledErr.Swap(false)
}

// touch records a response from member that does not yet show the watch
// current (a resumed watch's creation, see watchGroup).
func (s *subscriber) touch(member uint64) {
	s.heardAt.Store(time.Now().UnixNano())
	if member != 0 {
		s.member.Store(member)
	}
}

// startMonitor starts watching cli's connection and its watches' progress
// until stop.
func startMonitor(cli *clientv3.Client, endpoints []string, log *slog.Logger) *monitor {
	ctx, cancel := context.WithCancel(context.Background())
	m := &monitor{
		cli: cli, endpoints: strings.Join(endpoints, ","), endpointList: endpoints, log: log,
		cancel: cancel, done: make(chan struct{}),
		state: connectivity.Idle, subs: map[*subscriber]struct{}{},
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		m.run(ctx)
	}()
	go func() {
		defer wg.Done()
		m.watchProgress(ctx)
	}()
	go func() {
		wg.Wait()
		m.avoidMu.Lock()
		for _, cancel := range m.avoided {
			cancel()
		}
		m.avoidMu.Unlock()
		close(m.done)
	}()
	return m
}

// stop ends the monitor and waits for it.
func (m *monitor) stop() {
	m.cancel()
	<-m.done
}

// subscribe registers a watch of prefix on the stream numbered stream
// (watchContext) that publishes to pub, and tells pub the connection's
// state as last seen. A watch that resumes one that ended (resumed) stays
// reported stale until it hears from a member (hear).
func (m *monitor) subscribe(prefix string, pub statusReporter, stream uint64, resumed bool) *subscriber {
	sub := &subscriber{prefix: prefix, pub: pub, stream: stream, probes: make(chan *etcdserverpb.ResponseHeader, 1), stall: make(chan error, 1)}
	sub.heardAt.Store(time.Now().UnixNano())
	sub.stalledErr.Store(resumed)
	sub.unconfirmed.Store(resumed)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.subs[sub] = struct{}{}
	m.report(sub)
	return sub
}

// unsubscribe removes sub.
func (m *monitor) unsubscribe(sub *subscriber) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.subs, sub)
}

// report tells sub the connection's state: stale in transient failure,
// current when ready, nothing in between. A watch that resumes one that
// ended (a stall, "no leader") is current only once it hears from a
// member (hear): the connection
// is ready while any member answers, the stalled one included, and a
// resumed watch put back on the stalled member's stream was reported
// current while writes stayed invisible. (A watch clientv3 resumes itself
// after a reconnect is current when ready, as ever: it resumes past the
// store's revision, where etcd answers no progress request until the next
// write.) Callers hold m.mu.
func (m *monitor) report(sub *subscriber) {
	switch m.state {
	case connectivity.TransientFailure:
		sub.pub.Status(fmt.Errorf("source/etcd: %s unreachable", m.endpoints))
	case connectivity.Ready:
		if !sub.unconfirmed.Load() {
			sub.pub.Status(nil)
		}
	}
}

func (m *monitor) run(ctx context.Context) {
	conn := m.cli.ActiveConnection()
	state := conn.GetState()
	for {
		m.mu.Lock()
		m.state = state
		for sub := range m.subs {
			m.report(sub)
		}
		m.mu.Unlock()
		prev := state
		if !conn.WaitForStateChange(ctx, state) {
			return
		}
		state = conn.GetState()
		if state == connectivity.Ready && prev != connectivity.Ready {
			if h := m.probe(ctx); h != nil {
				m.deliver(h)
			}
		}
	}
}

// probe reads one key, counting only, and returns the response header;
// nil when the read fails (the watches report that). The key is a watched
// prefix — readable by kvmount's user, where an arbitrary key might not be
// — trying a few in turn.
func (m *monitor) probe(ctx context.Context) *etcdserverpb.ResponseHeader {
	m.mu.Lock()
	var prefixes []string
	for sub := range m.subs {
		if prefixes = append(prefixes, sub.prefix); len(prefixes) == 3 {
			break
		}
	}
	m.mu.Unlock()
	for _, prefix := range prefixes {
		rctx, cancel := context.WithTimeout(ctx, requestTimeout)
		key, _ := span(prefix)
		resp, err := m.cli.Get(rctx, key, clientv3.WithCountOnly())
		cancel()
		if err == nil {
			return resp.Header
		}
	}
	return nil
}

// deliver hands h to every subscriber, replacing a header not yet taken:
// the newer one says all the older one did.
func (m *monitor) deliver(h *etcdserverpb.ResponseHeader) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for sub := range m.subs {
		select {
		case <-sub.probes:
		default:
		}
		sub.probes <- h
	}
}
