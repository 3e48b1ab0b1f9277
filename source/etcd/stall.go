package etcd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Watching for a watch that silently stopped. A member that freezes (a
// SIGSTOP, a hung disk, a VM paused) keeps its TCP connections up: the
// client's connection state stays Ready while any member answers,
// WithRequireLeader never fires because the frozen member sends nothing,
// and etcd's own progress notifications come every 10 minutes. So the
// monitor asks: when the watches have heard nothing for ProgressIdle, it
// requests progress on their stream (clientv3 RequestProgress: one small
// message, answered by the member from its own store, never through Raft),
// and a stream that stays silent ProgressTimeout longer has stalled.
const (
	// ProgressIdle is how long the watches may be silent before the
	// monitor asks for progress.
	ProgressIdle = 1500 * time.Millisecond
	// ProgressTimeout is how long a progress request may go unanswered
	// before the watch counts as stalled: a stall is noticed at most
	// ProgressIdle + ProgressTimeout (4 s) after the last word from the
	// member. An idle, healthy watch costs one request and one wake-up
	// every ProgressTimeout.
	ProgressTimeout = 2500 * time.Millisecond
	// probeInterval is how often a member avoided after a stall is asked
	// for its status (Maintenance.Status, answered locally); once it
	// answers it is used again.
	probeInterval = 5 * time.Second
)

// errStalled is reported for the prefixes of a stalled watch.
var errStalled = errors.New("the etcd member serving the watch stopped answering")

// watchProgress requests progress on the watch stream when its watches
// have been silent for ProgressIdle, and reports a stream silent
// ProgressTimeout after the request as stalled: every subscriber is told
// its prefix is stale, the member that served the stream is avoided
// (avoid), and every watch starts again, on another member.
func (m *monitor) watchProgress(ctx context.Context) {
	// Watches share one stream per context metadata: the requests go on
	// theirs (WithRequireLeader).
	streamCtx := clientv3.WithRequireLeader(ctx)
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
		for sub := range m.subs {
			subs = append(subs, sub)
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
			m.stalled(ctx, subs, asked)
			asked = time.Time{}
		case !asked.IsZero() && last.Before(asked):
			next = ProgressTimeout - now.Sub(asked)
		case now.Sub(last) < ProgressIdle:
			asked = time.Time{}
			next = ProgressIdle - now.Sub(last)
		default:
			rctx, cancel := context.WithTimeout(streamCtx, time.Second)
			_ = m.cli.RequestProgress(rctx)
			cancel()
			m.progressRequests.Add(1)
			asked = now
			next = ProgressTimeout
		}
		wake.Reset(next)
	}
}

// stalled reports the subscribers that heard nothing since asked, and
// avoids the member their stream was on.
func (m *monitor) stalled(ctx context.Context, subs []*subscriber, asked time.Time) {
	var member uint64
	var stalled []*subscriber
	for _, sub := range subs {
		if sub.heard().After(asked) {
			continue
		}
		if id := sub.member.Load(); id != 0 {
			member = id
		}
		err := fmt.Errorf("%w: nothing heard from member %x for %v", errStalled, sub.member.Load(), time.Since(sub.heard()).Round(100*time.Millisecond))
		if !sub.stalledErr.Swap(true) {
			sub.pub.Status(err)
		}
		stalled = append(stalled, sub)
	}
	if member != 0 {
		m.avoid(ctx, member)
	}
	// Every watch on the stream starts again: once none is left on it,
	// clientv3 closes the stream, and the new one goes to a member the
	// client still uses. (gRPC closes a removed endpoint's connection
	// gracefully, waiting for its streams: a frozen member's would wait
	// for the keepalive to give up, 15 s.)
	for _, sub := range stalled {
		select {
		case sub.stall <- errStalled:
		default:
		}
	}
}

// avoid takes the client URLs of member out of the client's endpoints, if
// it has other endpoints, until the member answers again, so that the
// watches started again after a stall, and every request, go to another
// member.
func (m *monitor) avoid(ctx context.Context, member uint64) {
	m.avoidMu.Lock()
	defer m.avoidMu.Unlock()
	if m.avoided[member] != nil {
		return
	}
	urls := m.memberURLs(ctx, member)
	var keep, drop []string
	for _, ep := range m.cli.Endpoints() {
		if slices.Contains(urls, strings.TrimSuffix(ep, "/")) {
			drop = append(drop, ep)
		} else {
			keep = append(keep, ep)
		}
	}
	if len(drop) == 0 || len(keep) == 0 {
		return // nothing to avoid it with: the watch waits for it
	}
	m.log.Warn("avoiding a stalled etcd member until it answers again", "member", fmt.Sprintf("%x", member), "endpoints", strings.Join(drop, ","))
	m.cli.SetEndpoints(keep...)
	pctx, cancel := context.WithCancel(ctx)
	m.avoided[member] = cancel
	go m.probeMember(pctx, member, drop)
}

// probeMember asks an avoided member's endpoints for their status every
// probeInterval and puts them back among the client's endpoints once one
// answers.
func (m *monitor) probeMember(ctx context.Context, member uint64, endpoints []string) {
	t := time.NewTicker(probeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, ep := range endpoints {
			sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			_, err := m.cli.Status(sctx, ep)
			cancel()
			if err != nil {
				continue
			}
			m.avoidMu.Lock()
			delete(m.avoided, member)
			m.cli.SetEndpoints(m.endpointList...)
			m.avoidMu.Unlock()
			m.log.Info("stalled etcd member answers again; using it again", "member", fmt.Sprintf("%x", member), "endpoints", strings.Join(endpoints, ","))
			return
		}
	}
}

// memberURLs returns member's client URLs, asking the cluster (a few
// times: the request may land on the stalled member and time out).
func (m *monitor) memberURLs(ctx context.Context, member uint64) []string {
	for range 3 {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := m.cli.MemberList(rctx)
		cancel()
		if err != nil {
			continue
		}
		for _, mem := range resp.Members {
			if mem.ID == member {
				var urls []string
				for _, u := range mem.ClientURLs {
					urls = append(urls, strings.TrimSuffix(u, "/"))
				}
				return urls
			}
		}
		return nil
	}
	return nil
}
