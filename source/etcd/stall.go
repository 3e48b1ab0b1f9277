package etcd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// Watching for a watch that silently stopped. A member that freezes (a
// SIGSTOP, a hung disk, a VM paused) keeps its TCP connections up: the
// client's connection state stays Ready while any member answers,
// WithRequireLeader never fires because the frozen member sends nothing,
// and etcd's own progress notifications come every 10 minutes. So the
// monitor asks: when the watches have heard nothing for ProgressIdle, it
// requests progress on their stream (clientv3 RequestProgress: one small
// message, answered by the member from its own store, never through Raft).
//
// An unanswered request is not proof of a stall: etcd answers a progress
// request only once every watcher on the stream has caught up with the
// store (etcd 3.5+: mvcc's progressIfSync; 3.4 answers only the watchers
// that have), and a busy member — a thousand watches being created at a
// cold start — may take seconds to get there. So a request unanswered for
// ProgressTimeout is followed by a status probe of every endpoint
// (Maintenance.Status, also answered locally): only when the member that
// serves the watches (or, not knowing it, any endpoint) does not answer
// within ProbeTimeout is the stream stalled. Found stalled, its prefixes
// are reported stale; where other endpoints answered, the silent ones are
// avoided until they answer again and the watches resume on the others,
// each on a new stream, from the revision of the last event they routed
// (groupwatch.go), stale until the new stream answers a progress request
// or brings an event; with nothing else to go to, the watches stay where
// they are and resume when the member does.
const (
	// ProgressIdle is how long the watches may be silent before the
	// monitor asks for progress. A healthy, idle stream costs one
	// progress request every ProgressIdle.
	ProgressIdle = 1500 * time.Millisecond
	// ProgressTimeout is how long a progress request may go unanswered
	// before the endpoints are probed.
	ProgressTimeout = 1500 * time.Millisecond
	// ProbeTimeout is how long an endpoint has to answer a status probe.
	// A stall is noticed at most ProgressIdle + ProgressTimeout +
	// ProbeTimeout (4.5 s) after the last word from the member.
	ProbeTimeout = 1500 * time.Millisecond
	// probeInterval is how often an endpoint avoided after a stall is
	// asked for its status; once it answers it is used again.
	probeInterval = 5 * time.Second
)

// errStalled is reported for the prefixes of a stalled watch.
var errStalled = errors.New("the etcd member serving the watch stopped answering")

// watchProgress requests progress on the watch stream when its watches
// have been silent for ProgressIdle, and checks a stream still silent
// ProgressTimeout after the request (checkStall).
func (m *monitor) watchProgress(ctx context.Context) {
	var asked time.Time
	wake := time.NewTimer(ProgressIdle)
	defer wake.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-wake.C:
		}
		now := time.Now()
		m.mu.Lock()
		subs := make([]*subscriber, 0, len(m.subs))
		var last time.Time // the most recent word any watch heard
		streams := map[uint64]bool{}
		for sub := range m.subs {
			subs = append(subs, sub)
			streams[sub.stream] = true
			if h := sub.heard(); h.After(last) {
				last = h
			}
		}
		m.mu.Unlock()
		next := ProgressIdle
		switch {
		case len(subs) == 0:
			asked = time.Time{}
		case !asked.IsZero() && last.Before(asked) && now.Sub(asked) >= ProgressTimeout:
			m.checkStall(ctx, subs, asked)
			asked = time.Time{}
		case !asked.IsZero() && last.Before(asked):
			next = ProgressTimeout - now.Sub(asked)
		case now.Sub(last) < ProgressIdle:
			asked = time.Time{}
			next = ProgressIdle - now.Sub(last)
		default:
			// Watches share one stream per context metadata: the
			// requests go on each stream a watch is on (streamContext),
			// one stream but for a while after a stall.
			for stream := range streams {
				rctx, cancel := context.WithTimeout(streamContext(ctx, stream), time.Second)
				_ = m.cli.RequestProgress(rctx)
				cancel()
				m.progressRequests.Add(1)
			}
			asked = now
			next = ProgressTimeout
		}
		wake.Reset(next)
	}
}

// checkStall probes the endpoints after the subscribers that heard nothing
// since asked stayed silent past ProgressTimeout. The stream has stalled
// when an endpoint did not answer and the member serving the silent
// watches is not among those that did; then they are reported stale, and,
// if any endpoint answered, the silent ones are avoided and the watches
// start again on the others.
func (m *monitor) checkStall(ctx context.Context, subs []*subscriber, asked time.Time) {
	var silent []*subscriber
	serving := map[uint64]bool{}
	for _, sub := range subs {
		if !sub.heard().After(asked) {
			silent = append(silent, sub)
			if id := sub.member.Load(); id != 0 {
				serving[id] = true
			}
		}
	}
	if len(silent) == 0 {
		return
	}
	answered, unanswered := m.probeEndpoints(ctx)
	m.statusProbes.Add(1)
	if len(unanswered) == 0 {
		return // every endpoint answers: the stream is busy, not stalled
	}
	for id := range serving {
		if !answered[id] {
			serving = nil // the member serving the watches is silent
			break
		}
	}
	if len(serving) > 0 {
		return
	}
	for _, sub := range silent {
		err := fmt.Errorf("%w: nothing heard from member %x for %v, no status from %s within %v",
			errStalled, sub.member.Load(), time.Since(sub.heard()).Round(100*time.Millisecond), strings.Join(unanswered, ","), ProbeTimeout)
		if !sub.stalledErr.Swap(true) {
			sub.pub.Status(err)
		}
	}
	if len(answered) == 0 || !m.avoid(ctx, unanswered) {
		// Nowhere else to go: the stream resumes when the member does
		// (and keepalive ends a connection that is truly gone).
		return
	}
	// Every silent watch starts again, on a new stream (watchContext),
	// which goes to an endpoint the client still uses: clientv3 would put
	// a watch started before the old stream closed — it closes once no
	// watch is left on it — back on it, to the frozen member. (gRPC closes
	// a removed endpoint's connection gracefully, waiting for its
	// streams: a frozen member's would wait for the keepalive to give up,
	// 15 s.)
	m.stream.Add(1)
	for _, sub := range silent {
		select {
		case sub.stall <- errStalled:
		default:
		}
	}
}

// probeEndpoints asks every endpoint the client uses for its status at
// once, each within ProbeTimeout, and returns the IDs of the members that
// answered and the endpoints that did not.
func (m *monitor) probeEndpoints(ctx context.Context) (answered map[uint64]bool, unanswered []string) {
	endpoints := m.cli.Endpoints()
	ids := make([]uint64, len(endpoints))
	var wg sync.WaitGroup
	for i, ep := range endpoints {
		wg.Go(func() {
			sctx, cancel := context.WithTimeout(ctx, ProbeTimeout)
			defer cancel()
			if resp, err := m.cli.Status(sctx, ep); err == nil && resp.Header != nil {
				ids[i] = resp.Header.MemberId
			}
		})
	}
	wg.Wait()
	answered = map[uint64]bool{}
	for i, id := range ids {
		if id == 0 {
			unanswered = append(unanswered, endpoints[i])
		} else {
			answered[id] = true
		}
	}
	return answered, unanswered
}

// avoid takes endpoints out of the client's endpoints until one of them
// answers again, so that the watches started again after a stall, and
// every request, go to another member. It reports whether it did: an
// endpoint avoided already stays so, and the client keeps at least one.
func (m *monitor) avoid(ctx context.Context, endpoints []string) bool {
	m.avoidMu.Lock()
	defer m.avoidMu.Unlock()
	var keep, drop []string
	for _, ep := range m.cli.Endpoints() {
		if slices.Contains(endpoints, ep) {
			drop = append(drop, ep)
		} else {
			keep = append(keep, ep)
		}
	}
	if len(drop) == 0 || len(keep) == 0 {
		return false
	}
	m.log.Warn("avoiding a stalled etcd member until it answers again", "endpoints", strings.Join(drop, ","))
	m.cli.SetEndpoints(keep...)
	pctx, cancel := context.WithCancel(ctx)
	m.avoided = append(m.avoided, cancel)
	go m.probeAvoided(pctx, drop)
	return true
}

// probeAvoided asks avoided endpoints for their status every
// probeInterval and gives the client back its configured endpoints once
// one answers.
func (m *monitor) probeAvoided(ctx context.Context, endpoints []string) {
	t := time.NewTicker(probeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, ep := range endpoints {
			sctx, cancel := context.WithTimeout(ctx, ProbeTimeout)
			_, err := m.cli.Status(sctx, ep)
			cancel()
			if err != nil {
				continue
			}
			m.avoidMu.Lock()
			m.cli.SetEndpoints(m.endpointList...)
			m.avoidMu.Unlock()
			m.log.Info("stalled etcd member answers again; using it again", "endpoints", strings.Join(endpoints, ","))
			return
		}
	}
}
