package etcd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvmount/kvmount/source"
)

// A group's loop: read its members (groupread.go), then watch its prefix
// from that revision and route each event to the members it falls in,
// until an error says to read again, back off, or split the group.

// runGroup runs g's watch until ctx is done: a read of every member at one
// revision and a watch from it, again after each error (with backoff,
// and at once for a resync); after a watch that stalled or ended for want
// of a leader (errResume), the watch alone, from where it stood — at once
// after a stall, after the backoff otherwise, which then waits at most
// resumeRetryMax. The backoff starts again from its shortest once a watch
// is established.
func (s *Source) runGroup(ctx context.Context, g *group) {
	log := s.log.With("group", g.prefix)
	bo := source.NewBackoff()
	var resume *errResume
	for {
		err := s.groupCycle(ctx, g, log, resume, bo.Reset)
		if ctx.Err() != nil {
			return
		}
		// Any other error than an errResume reads the prefixes again.
		if resume = nil; errors.As(err, &resume) && resume.stalled {
			log.Info("watching the group's prefix again, on another member, from where it stood", "revision", resume.rev, "reason", resume.err)
			continue
		}
		if errors.Is(err, errResync) {
			log.Info("re-reading the group's prefixes", "reason", err)
			continue
		}
		if errors.Is(err, errRefusedGroup) {
			log.Warn("etcd refuses a watch of the prefix the group's mounts share (authorization): each is watched on its own from now on", "err", err)
			s.gmu.Lock()
			s.refusedPrefixes = append(s.refusedPrefixes, g.prefix)
			if s.regrouping == nil {
				s.regrouping = time.AfterFunc(0, s.regroup)
			}
			s.gmu.Unlock()
			<-ctx.Done()
			return
		}
		wait := bo.NextBackOff()
		if resume != nil && wait > resumeRetryMax {
			wait = source.Jitter(resumeRetryMax)
		}
		attrs := []any{"err", err, "prefixes", len(g.snapshot()), "retry_in", wait.Round(time.Millisecond)}
		if resume != nil {
			attrs = append(attrs, "resume_from", resume.rev)
		}
		log.Warn("source unavailable, keeping last content", attrs...)
		for _, m := range g.snapshot() {
			m.status(err)
		}
		if !source.Sleep(ctx, wait) {
			return
		}
	}
}

// resumeRetryMax bounds the wait between a group's tries to resume its
// watch (errResume: a member without a leader, or none reachable while
// resuming), ±10 %: a resume reads nothing — a watch from a revision, which
// etcd refuses at once while it has no leader — so it needs less shielding
// than a read, which keeps the backoff up to source.RetryMax; a quorum
// back is found within it however long it was lost (at 1,000 daemons,
// about 200 watch requests a second in all while it is lost).
const resumeRetryMax = 5 * time.Second

// errRefusedGroup is returned by a group's cycle when etcd refuses the
// watch of its prefix, which covers several members, for want of
// permission.
var errRefusedGroup = errors.New("source/etcd: permission denied for the group's prefix")

// revisions checks the response headers a group sees (follower.observe's
// rules): a revision lower than one seen, or another cluster ID, is a
// resync.
type revisions struct {
	seen    int64
	cluster uint64
}

// observe checks h against what was seen; see follower.observe.
func (r *revisions) observe(h *etcdserverpb.ResponseHeader) error {
	if h == nil || h.Revision == 0 {
		return nil
	}
	switch {
	case r.cluster != 0 && h.ClusterId != 0 && h.ClusterId != r.cluster:
		return fmt.Errorf("%w: etcd cluster ID changed from %x to %x (a new or restored cluster)", errResync, r.cluster, h.ClusterId)
	case h.Revision < r.seen:
		return fmt.Errorf("%w: etcd revision went back from %d to %d (data lost, or restored from a snapshot without --bump-revision)", errResync, r.seen, h.Revision)
	}
	r.seen = h.Revision
	if h.ClusterId != 0 {
		r.cluster = h.ClusterId
	}
	return nil
}

// errResume is returned by a group's watch that ended after it had routed
// every event up to rev, for a reason that leaves the store's history as
// it was: it stalled (stall.go, stalled set), or etcd ended it with
// "etcdserver: no leader", which WithRequireLeader brings when the member
// loses its quorum. (A watch the server cancels for another reason, and
// any other error, is read again, as before.) The group
// watches again from rev — after a stall at once, on a new stream to
// another member; otherwise after the backoff — instead of reading its
// prefixes again: a lost member or quorum makes a fleet resume, not
// re-read (issue 37's herds). A revision compacted meanwhile is refused
// by etcd and read again, as ever. revs are the revision checks' state,
// kept across.
type errResume struct {
	err     error
	rev     int64
	revs    revisions
	stalled bool
}

func (e *errResume) Error() string { return e.err.Error() }
func (e *errResume) Unwrap() error { return e.err }

// groupCycle reads every member of g at one revision, publishes each, and
// watches g's prefix from that revision until the watch ends; resuming a
// watch that ended (resume), it watches from where that stood and reads
// nothing but members not read yet; one that cannot connect returns the
// resume again. It always returns an error saying why.
func (s *Source) groupCycle(ctx context.Context, g *group, log *slog.Logger, resume *errResume, established func()) error {
	cli, mon, err := s.connect()
	if err == nil {
		err = s.ready(ctx, cli)
	}
	if err != nil && resume != nil {
		// No connection yet (every member down): the next cycle
		// resumes as this one would have.
		return &errResume{err: err, rev: resume.rev, revs: resume.revs}
	}
	if err != nil {
		return err
	}
	if resume != nil {
		// The members keep their snapshots and floors; a revision
		// compacted meanwhile is a resync, as ever.
		revs := resume.revs
		return s.watchGroup(ctx, cli, mon, g, log, &revs, resume.rev, true, established)
	}
	var revs revisions
	var rev int64
	start := time.Now()
	members := g.snapshot()
	for _, m := range members {
		m.read, m.held = false, nil
		m.active.Store(false)
	}
	// The first read pins the revision (members over their limits are
	// held and the next one tries); the others are read at it, in spans
	// of members several at once (readRuns).
	var first *memberRead
	for len(members) > 0 && rev == 0 {
		m := members[0]
		members = members[1:]
		r, err := s.readMemberAt(ctx, cli, m, 0)
		if err != nil {
			return err
		}
		if r != nil {
			rev = r.header.Revision
			// A read is the new truth: whatever was seen before.
			revs = revisions{seen: rev, cluster: r.header.ClusterId}
			first = r
		}
	}
	pub := &readPublisher{rev: rev}
	if first != nil {
		pub.add(*first)
	}
	if err := s.readRuns(ctx, cli, members, rev, nil, pub); err != nil {
		return err
	}
	pub.flush()
	log.Debug("read the group's prefixes", "prefixes", len(members)+1, "revision", rev, "took", time.Since(start).Round(time.Millisecond))
	// With every member held (or none left), rev is 0: the watch starts
	// from the latest revision, and a member's own read later sets its
	// floor.
	if testHookAfterList != nil {
		testHookAfterList()
	}
	return s.watchGroup(ctx, cli, mon, g, log, &revs, rev, false, established)
}

// watchGroup follows g's prefix from rev (0: the latest), publishing once
// per watch response for each member it touches, until the watch ends; it
// always returns an error saying why: an *errResume when it stalled, or
// ended for want of a leader, after it had routed what it was sent
// (delivered). established is called when the member takes the watch.
// Members that joined, and held members whose retry is due, are read on
// their own meanwhile. A watch that resumes an earlier one (resumed) keeps
// its prefixes stale until its stream shows it delivers: a progress
// notification, asked for as soon as the watch is created, or an event.
func (s *Source) watchGroup(ctx context.Context, cli *clientv3.Client, mon *monitor, g *group, log *slog.Logger, revs *revisions, rev int64, resumed bool, established func()) error {
	sctx, stream := mon.watchContext(ctx)
	wctx, cancel := context.WithCancel(sctx)
	defer cancel()
	probeKey := g.prefix
	if ms := g.snapshot(); len(ms) > 0 {
		probeKey = ms[0].prefix // readable by kvmount's user, where the group's prefix might not be
	}
	sub := mon.subscribe(probeKey, g, stream, resumed)
	defer mon.unsubscribe(sub)
	key, end := span(g.prefix)
	// From rev, not rev+1: see follower.watch before issue 37 — the
	// events of rev change nothing when folded in again, and a watch
	// whose start revision is not beyond the store's is one etcd answers
	// progress requests for (stall.go).
	opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithProgressNotify(), clientv3.WithCreatedNotify()}
	if rev > 0 {
		opts = append(opts, clientv3.WithRev(rev))
	}
	wch := cli.Watch(wctx, key, opts...)
	// delivered is the revision up to which every event of the prefix has
	// been routed: the one the watch started from (the reads hold what
	// came before), then the last event's. Progress notifications do not
	// move it: an etcd without the fix of etcd-io/etcd#15220 (backported
	// to 3.5 and 3.4 in 2023) could send one ahead of events still to
	// come.
	delivered := rev
	retry := time.NewTimer(time.Hour)
	defer retry.Stop()
	for {
		// The members that joined, or whose retry is due, are read now;
		// the timer is set for the next retry.
		var due []*member
		for _, m := range g.snapshot() {
			if !m.read && m.held == nil || m.held != nil && !time.Now().Before(m.retry) {
				due = append(due, m)
			}
		}
		if err := s.readMembers(ctx, cli, due, revs); err != nil {
			return err
		}
		next := time.Time{}
		for _, m := range g.snapshot() {
			if m.held != nil && (next.IsZero() || m.retry.Before(next)) {
				next = m.retry
			}
		}
		if !next.IsZero() {
			retry.Reset(time.Until(next))
		}
		var resp clientv3.WatchResponse
		var ok bool
		select {
		case h := <-sub.probes:
			if err := revs.observe(h); err != nil {
				return err
			}
			continue
		case err := <-sub.stall:
			if delivered > 0 {
				return &errResume{err: err, rev: delivered, revs: *revs, stalled: true}
			}
			return fmt.Errorf("%w: %w", errResync, err)
		case <-g.wake:
			continue
		case <-retry.C:
			continue
		case resp, ok = <-wch:
		}
		if !ok {
			break
		}
		if err := revs.observe(&resp.Header); err != nil {
			return err
		}
		if err := resp.Err(); err != nil {
			switch {
			case errors.Is(err, rpctypes.ErrCompacted):
				return fmt.Errorf("%w: watch compacted at revision %d", errResync, resp.CompactRevision)
			case permissionDenied(err) && s.wider(g):
				return fmt.Errorf("%w: %w", errRefusedGroup, err)
			}
			err = fmt.Errorf("source/etcd: watch %s: %w", g.prefix, err)
			if delivered > 0 && errors.Is(err, rpctypes.ErrNoLeader) {
				// The member lost its quorum (WithRequireLeader): what
				// was routed stands, and the store's history with it.
				return &errResume{err: err, rev: delivered, revs: *revs}
			}
			return err
		}
		if resp.Canceled {
			return fmt.Errorf("%w: watch cancelled by the server", errResync)
		}
		// Only now is the response word that the watch delivers: an
		// error ends it (a member without a leader refuses a resumed
		// watch this way), and heard, it would show the prefixes current
		// for the moment before they are reported stale again.
		if resp.Created {
			established()
		}
		if resp.Created && resumed {
			// Created says the member took the watch, not that it
			// delivers: progress is asked for on its stream at once.
			sub.touch(resp.Header.MemberId)
			rctx, rcancel := context.WithTimeout(wctx, requestTimeout)
			_ = cli.RequestProgress(rctx)
			rcancel()
			continue
		}
		if sub.hear(resp.Header.MemberId) {
			log.Info("watch answers again", "member", fmt.Sprintf("%x", resp.Header.MemberId))
			g.Status(nil)
		}
		if resp.Created || resp.IsProgressNotify() {
			g.Status(nil)
			continue
		}
		s.route(g, resp)
		if n := len(resp.Events); n > 0 {
			delivered = max(delivered, resp.Events[n-1].Kv.ModRevision)
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return fmt.Errorf("%w: watch channel closed", errResync)
}

// permissionDenied reports whether err is etcd's refusal for want of
// permission: clientv3 hands a watch's as a plain error of the status's
// text.
func permissionDenied(err error) bool {
	return status.Code(err) == codes.PermissionDenied || errors.Is(err, rpctypes.ErrPermissionDenied) ||
		strings.Contains(err.Error(), rpctypes.ErrPermissionDenied.Error())
}

// wider reports whether g's prefix is wider than its members': a group
// that authorization may refuse where it grants the members' own.
func (s *Source) wider(g *group) bool {
	ms := g.snapshot()
	return len(ms) > 1 || len(ms) == 1 && ms[0].prefix != g.prefix
}

// route folds resp's events into the members they concern and publishes
// each member that changed once, at the response's revision. An event at
// or below a member's floor is in its last read already; a held member,
// or one not read yet, takes none (it is read on its own).
func (s *Source) route(g *group, resp clientv3.WatchResponse) {
	batches := map[*member][]*clientv3.Event{}
	var order []*member
	g.mu.Lock()
	for _, ev := range resp.Events {
		for _, m := range g.matching(string(ev.Kv.Key)) {
			if !m.read || m.held != nil || ev.Kv.ModRevision <= m.floor {
				continue
			}
			if _, ok := batches[m]; !ok {
				order = append(order, m)
			}
			batches[m] = append(batches[m], ev)
		}
	}
	g.mu.Unlock()
	for _, m := range order {
		lim := m.pub.Limits()
		next, nextOversized, changed := apply(m.last, m.lastOversized, m.prefix, batches[m], lim)
		if !changed {
			continue
		}
		if err := lim.Check(next.Len()+len(nextOversized), next.ValueBytes()); err != nil {
			s.hold(m, fmt.Errorf("source/etcd: %s: %w", m.prefix, err))
			continue
		}
		m.deliver(next, nextOversized, resp.Header.Revision)
	}
}
