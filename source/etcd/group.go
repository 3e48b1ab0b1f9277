package etcd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvmount/kvmount/source"
)

// In watch mode a Source follows all its prefixes with at most maxWatches
// watches, whatever their number, as the Consul source does with its
// blocking queries (source.Partition): each watch is on the longest
// prefix a group of them has in common, and each prefix's events are
// routed to it from that watch. A thousand mounts are a handful of
// watchers on the member, not a thousand.
//
// A group reads its members' prefixes at one revision (each in pages, at
// the revision the first read pinned), publishes each, then watches the
// group's prefix from that revision. Each watch response is folded into
// every member it touches and published once per member — the keys of
// one transaction switch together, as before. A member that joins a
// running group is read on its own, at the latest revision, and takes
// the group's events from there on (an event at or below the revision of
// its own read is in that read already). A member whose prefix grows
// past its limits is reported with the error and read again on its own
// after a backoff, while the group's watch goes on for the others.
// Compaction, a watch cancelled by the server, a revision that goes back
// or a new cluster ID make the whole group read again; a stalled member
// (stall.go) makes it start again elsewhere.
//
// Where etcd's authorization refuses the watch of a group's prefix (a
// user granted each prefix alone), the group's members are watched one by
// one from then on.

// maxWatches is the most watches a Source runs at once in watch mode
// (more only where authorization refuses a group's prefix).
const maxWatches = 8

// settleJoins is how long the grouping waits after a Follow whose prefix
// no running group covers, so that the prefixes of a start — a thousand
// mounts joining within milliseconds — are grouped once: each such Follow
// puts the grouping off by settleJoins again, up to settleJoinsMax after
// the first.
const (
	settleJoins    = 20 * time.Millisecond
	settleJoinsMax = 250 * time.Millisecond
)

// concurrentReads is how many of a group's prefixes are read at once when
// the group starts or re-reads: the start of a thousand mounts is not a
// thousand reads in a row.
const concurrentReads = 16

// member is one Follow in watch mode.
type member struct {
	prefix string
	pub    source.Publisher
	log    *slog.Logger
	// last is the snapshot last published, nil before the first, and
	// lastOversized its keys whose values were not kept.
	last          map[string][]byte
	lastOversized map[string]int64
	// The fields below belong to the loop of the member's group.
	//
	// floor is the revision of the member's last read: an event at or
	// below it is in that read already. read is false until the group
	// has read the member (it joined a running group, or was held).
	floor int64
	read  bool
	// held is the member's error while it is over its limits, retried
	// (read on its own) at retry.
	held  error
	retry time.Time
	bo    *backoff.ExponentialBackOff
	// active is read and held == nil, for the monitor's goroutine.
	active atomic.Bool

	// mu orders what is delivered to pub with the member's end: nothing
	// is once gone is set (leave), so that a Follow that returned
	// publishes nothing more — its feed may follow a new instance.
	mu   sync.Mutex
	gone bool
}

// status reports err for m's prefix, unless m is gone.
func (m *member) status(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.gone {
		m.pub.Status(err)
	}
}

// deliver publishes entries and oversized at rev, unless m is gone.
func (m *member) deliver(entries map[string][]byte, oversized map[string]int64, rev int64) {
	m.last, m.lastOversized = entries, oversized
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.gone {
		m.pub.Publish(source.Snapshot{Revision: strconv.FormatInt(rev, 10), Missing: len(entries)+len(oversized) == 0, Entries: entries, Oversized: oversized})
	}
}

// publish delivers entries and oversized at rev unless they equal the
// last snapshot, in which case it only reports the prefix current.
func (m *member) publish(entries map[string][]byte, oversized map[string]int64, rev int64) {
	if m.last != nil && maps.EqualFunc(entries, m.last, bytes.Equal) && maps.Equal(oversized, m.lastOversized) {
		m.status(nil)
		return
	}
	m.deliver(entries, oversized, rev)
}

// setRead records that m was read at floor (and is not held).
func (m *member) setRead(floor int64) {
	m.floor, m.read, m.held = floor, true, nil
	m.active.Store(true)
	m.bo.Reset()
}

// group is one watch: the members whose prefixes start with its prefix.
type group struct {
	prefix string
	cancel context.CancelFunc
	done   chan struct{}

	mu sync.Mutex
	// members are sorted by prefix; byPrefix finds them by their prefix.
	members  []*member
	byPrefix map[string][]*member
	// wake tells the loop that a member joined; it holds one.
	wake chan struct{}
}

// add makes m a member of g and wakes g's loop to read it.
func (g *group) add(m *member) {
	g.mu.Lock()
	i, _ := slices.BinarySearchFunc(g.members, m.prefix, func(x *member, p string) int { return strings.Compare(x.prefix, p) })
	g.members = slices.Insert(g.members, i, m)
	g.byPrefix[m.prefix] = append(g.byPrefix[m.prefix], m)
	g.mu.Unlock()
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

// remove takes m out of g; it reports whether g has members left.
func (g *group) remove(m *member) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.members = slices.DeleteFunc(g.members, func(x *member) bool { return x == m })
	g.byPrefix[m.prefix] = slices.DeleteFunc(g.byPrefix[m.prefix], func(x *member) bool { return x == m })
	if len(g.byPrefix[m.prefix]) == 0 {
		delete(g.byPrefix, m.prefix)
	}
	return len(g.members) > 0
}

// snapshot returns g's members now.
func (g *group) snapshot() []*member {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.members)
}

// matching returns the members of g whose prefix key starts with, from
// byPrefix: every prefix of key at least as long as g's is looked up.
// g.mu is held.
func (g *group) matching(key string) []*member {
	var out []*member
	for n := len(g.prefix); n <= len(key); n++ {
		out = append(out, g.byPrefix[key[:n]]...)
	}
	return out
}

// Status implements the monitor's publisher: the connection's state and
// a stall are every member's that is read and not held.
func (g *group) Status(err error) {
	for _, m := range g.snapshot() {
		if m.active.Load() {
			m.status(err)
		}
	}
}

// followWatched follows prefix in watch mode: it joins the group that
// covers it, or has the prefixes grouped anew, and leaves when ctx is
// done.
func (s *Source) followWatched(ctx context.Context, prefix string, pub source.Publisher) error {
	m := &member{prefix: prefix, pub: pub, log: s.log.With("prefix", prefix), bo: source.NewBackoff()}
	s.join(m)
	<-ctx.Done()
	s.leave(m)
	return ctx.Err()
}

// join registers m: the running group that covers its prefix takes it,
// else the prefixes are grouped anew after settleJoins.
func (s *Source) join(m *member) {
	s.gmu.Lock()
	defer s.gmu.Unlock()
	i, _ := slices.BinarySearchFunc(s.members, m.prefix, func(x *member, p string) int { return strings.Compare(x.prefix, p) })
	s.members = slices.Insert(s.members, i, m)
	if g, ok := source.CoveringGroup(slices.Collect(maps.Keys(s.groups)), m.prefix); ok && s.regrouping == nil {
		s.groups[g].add(m)
		return
	}
	switch now := time.Now(); {
	case s.regrouping == nil:
		s.regrouping, s.regroupBy = time.AfterFunc(settleJoins, s.regroup), now.Add(settleJoinsMax)
	case now.Add(settleJoins).Before(s.regroupBy) && s.regrouping.Stop():
		// Not fired yet: put off. (Once fired, the regrouping takes m
		// with the others: it reads the members under gmu.)
		s.regrouping = time.AfterFunc(settleJoins, s.regroup)
	}
}

// leave unregisters m, which delivers nothing from then on; a group left
// without members stops.
func (s *Source) leave(m *member) {
	m.mu.Lock()
	m.gone = true
	m.mu.Unlock()
	s.gmu.Lock()
	s.members = slices.DeleteFunc(s.members, func(x *member) bool { return x == m })
	var stop *group
	for prefix, g := range s.groups {
		if strings.HasPrefix(m.prefix, prefix) && !g.remove(m) {
			delete(s.groups, prefix)
			stop = g
		}
	}
	s.gmu.Unlock()
	if stop != nil {
		stop.cancel()
		<-stop.done
	}
}

// regroup partitions the members' prefixes anew (source.Partition): a
// group that stays keeps running — taking the members it now covers —,
// one that goes stops, and a new one starts. Prefixes under one whose
// watch authorization refused are groups of their own.
func (s *Source) regroup() {
	s.gmu.Lock()
	s.regrouping = nil
	var wide, own []string
	for _, m := range s.members {
		if _, ok := source.CoveringGroup(s.refusedPrefixes, m.prefix); ok {
			own = append(own, m.prefix)
		} else {
			wide = append(wide, m.prefix)
		}
	}
	prefixes := append(source.Partition(wide, maxWatches), slices.Compact(own)...)
	var stop []*group
	for prefix, g := range s.groups {
		if !slices.Contains(prefixes, prefix) {
			delete(s.groups, prefix)
			stop = append(stop, g)
		}
	}
	s.log.Debug("grouped the prefixes", "prefixes", len(s.members), "groups", prefixes, "stopping", len(stop))
	s.gmu.Unlock()
	// The groups that go stop first: a member is in one group at a time.
	for _, g := range stop {
		g.cancel()
		<-g.done
	}
	s.gmu.Lock()
	defer s.gmu.Unlock()
	if s.closed {
		return
	}
	for _, prefix := range prefixes {
		g := s.groups[prefix]
		if g == nil {
			g = &group{prefix: prefix, byPrefix: map[string][]*member{}, wake: make(chan struct{}, 1)}
		}
		for _, m := range s.members {
			if owner, _ := ownerOf(prefixes, m.prefix); owner == prefix && !slices.Contains(g.snapshot(), m) {
				m.read = false
				m.active.Store(false)
				g.add(m)
			}
		}
		if s.groups[prefix] == nil {
			s.groups[prefix] = g
			ctx, cancel := context.WithCancel(context.Background())
			g.cancel, g.done = cancel, make(chan struct{})
			go func() {
				defer close(g.done)
				s.runGroup(ctx, g)
			}()
		}
	}
}

// ownerOf returns the group of groups that prefix belongs to: the longest
// that prefix starts with (a prefix refused by authorization is its own
// group, inside what would have covered it).
func ownerOf(groups []string, prefix string) (string, bool) {
	best, ok := "", false
	for _, g := range groups {
		if strings.HasPrefix(prefix, g) && (!ok || len(g) > len(best)) {
			best, ok = g, true
		}
	}
	return best, ok
}

// runGroup runs g's watch until ctx is done: a read of every member at one
// revision and a watch from it, again after each error (with backoff,
// and at once for a resync).
func (s *Source) runGroup(ctx context.Context, g *group) {
	log := s.log.With("group", g.prefix)
	bo := source.NewBackoff()
	for {
		err := s.groupCycle(ctx, g, log)
		if ctx.Err() != nil {
			return
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
		if err != nil {
			log.Warn("source unavailable, keeping last content", "err", err, "prefixes", len(g.snapshot()))
			for _, m := range g.snapshot() {
				m.status(err)
			}
			if !source.Sleep(ctx, bo.NextBackOff()) {
				return
			}
			continue
		}
		bo.Reset()
	}
}

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

// groupCycle reads every member of g at one revision, publishes each, and
// watches g's prefix from that revision until the watch ends; it always
// returns an error saying why.
func (s *Source) groupCycle(ctx context.Context, g *group, log *slog.Logger) error {
	cli, mon, err := s.connect()
	if err != nil {
		return err
	}
	if err := s.ready(ctx, cli); err != nil {
		return err
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
	// held and the next one tries); the others are read at it, several at
	// once, as a thousand followers each reading its own prefix did.
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
	eg, ectx := errgroup.WithContext(ctx)
	eg.SetLimit(concurrentReads)
	for _, m := range members {
		eg.Go(func() error {
			r, err := s.readMemberAt(ectx, cli, m, rev)
			if r != nil {
				pub.add(*r)
			}
			return err
		})
	}
	if err := eg.Wait(); err != nil {
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
	return s.watchGroup(ctx, cli, mon, g, log, &revs, rev)
}

// memberRead is what a read of a member's prefix returned.
type memberRead struct {
	m         *member
	entries   map[string][]byte
	oversized map[string]int64
	header    *etcdserverpb.ResponseHeader
}

// readMemberAt reads m's prefix at rev (0: the latest, which it then
// pins); a member over its limits is held and its read is nil. A
// compacted rev is a resync.
func (s *Source) readMemberAt(ctx context.Context, cli *clientv3.Client, m *member, rev int64) (*memberRead, error) {
	entries, oversized, h, err := listPrefix(ctx, cli, m.prefix, m.pub.Limits(), rev)
	if errors.Is(err, rpctypes.ErrCompacted) {
		return nil, fmt.Errorf("%w: revision compacted during read", errResync)
	}
	if errors.Is(err, source.ErrOverLimits) {
		s.hold(m, err)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return &memberRead{m: m, entries: entries, oversized: oversized, header: h}, nil
}

// publishBatch is how many read members' snapshots are published
// together: a thousand mounts' snapshots reach the populator in bursts
// that one pass each takes — not a thousand passes over a thousand mounts
// — while the reads of the next go on.
const publishBatch = 64

// readPublisher publishes the reads of a group's members in batches of
// publishBatch, each member at rev, or (rev 0) at the revision of its own
// read, setting its floor there.
type readPublisher struct {
	rev     int64
	mu      sync.Mutex
	pending []memberRead
}

// add queues r, and publishes the batch it completes.
func (p *readPublisher) add(r memberRead) {
	p.mu.Lock()
	p.pending = append(p.pending, r)
	var batch []memberRead
	if len(p.pending) >= publishBatch {
		batch, p.pending = p.pending, nil
	}
	p.mu.Unlock()
	p.publish(batch)
}

// flush publishes what is queued.
func (p *readPublisher) flush() {
	p.mu.Lock()
	batch := p.pending
	p.pending = nil
	p.mu.Unlock()
	p.publish(batch)
}

func (p *readPublisher) publish(batch []memberRead) {
	for _, r := range batch {
		at := p.rev
		if at == 0 {
			at = r.header.Revision
		}
		r.m.setRead(at)
		r.m.publish(r.entries, r.oversized, at)
	}
}

// hold reports m over its limits with err, and sets its retry after its
// backoff: its prefix is read on its own then.
func (s *Source) hold(m *member, err error) {
	m.held, m.read = err, false
	m.active.Store(false)
	m.retry = time.Now().Add(m.bo.NextBackOff())
	m.log.Warn("source unavailable, keeping last content", "err", err)
	m.status(err)
}

// readMembers reads each of ms on its own, concurrentReads at once, at
// the latest revision, and publishes them together (publishReads): the
// group's events from then on are theirs, each from its read's revision
// (its floor). It returns an error other than a member's own limits,
// which ends the watch.
func (s *Source) readMembers(ctx context.Context, cli *clientv3.Client, ms []*member, revs *revisions) error {
	var mu sync.Mutex // guards revs
	pub := &readPublisher{}
	base := revs.seen
	eg, ectx := errgroup.WithContext(ctx)
	eg.SetLimit(concurrentReads)
	for _, m := range ms {
		eg.Go(func() error {
			r, err := s.readMemberAt(ectx, cli, m, 0)
			if r == nil || err != nil {
				return err
			}
			// Reads run at once and end in any order: each is checked
			// against what was seen before them all.
			mu.Lock()
			check := revisions{seen: base, cluster: revs.cluster}
			err = check.observe(r.header)
			revs.seen, revs.cluster = max(revs.seen, check.seen), check.cluster
			mu.Unlock()
			if err != nil {
				return err
			}
			pub.add(*r)
			return nil
		})
	}
	if err := eg.Wait(); err != nil {
		return err
	}
	pub.flush()
	return nil
}

// watchGroup follows g's prefix from rev (0: the latest), publishing once
// per watch response for each member it touches, until the watch ends; it
// always returns an error saying why. Members that joined, and held
// members whose retry is due, are read on their own meanwhile.
func (s *Source) watchGroup(ctx context.Context, cli *clientv3.Client, mon *monitor, g *group, log *slog.Logger, revs *revisions, rev int64) error {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	probeKey := g.prefix
	if ms := g.snapshot(); len(ms) > 0 {
		probeKey = ms[0].prefix // readable by kvmount's user, where the group's prefix might not be
	}
	sub := mon.subscribe(probeKey, g)
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
		if sub.hear(resp.Header.MemberId) {
			log.Info("watch answers again", "member", fmt.Sprintf("%x", resp.Header.MemberId))
			g.Status(nil)
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
			return fmt.Errorf("source/etcd: watch %s: %w", g.prefix, err)
		}
		if resp.Canceled {
			return fmt.Errorf("%w: watch cancelled by the server", errResync)
		}
		if resp.Created || resp.IsProgressNotify() {
			g.Status(nil)
			continue
		}
		s.route(g, resp)
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
		if err := lim.Check(len(next)+len(nextOversized), valueBytes(next)); err != nil {
			s.hold(m, fmt.Errorf("source/etcd: %s: %w", m.prefix, err))
			continue
		}
		m.deliver(next, nextOversized, resp.Header.Revision)
	}
}
