package etcd

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/kvmount/kvmount/kvset"
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
// (stall.go) makes its watch resume elsewhere, on a new stream, from the
// revision of the last event it routed, reading nothing again, and a
// watch etcd ended for want of a leader resumes so after the backoff.
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

// member is one Follow in watch mode.
type member struct {
	prefix string
	pub    source.Publisher
	log    *slog.Logger
	// last is the snapshot last published (published is false before
	// the first), and lastOversized its keys whose values were not kept.
	last          kvset.Set
	lastOversized map[string]int64
	published     bool
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
func (m *member) deliver(entries kvset.Set, oversized map[string]int64, rev int64) {
	m.last, m.lastOversized, m.published = entries, oversized, true
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.gone {
		m.pub.Publish(source.Snapshot{Revision: strconv.FormatInt(rev, 10), Missing: entries.Len()+len(oversized) == 0, Entries: entries, Oversized: oversized})
	}
}

// publish delivers entries and oversized at rev unless they equal the
// last snapshot, in which case it only reports the prefix current.
func (m *member) publish(entries kvset.Set, oversized map[string]int64, rev int64) {
	if m.published && kvset.Equal(entries, m.last) && maps.Equal(oversized, m.lastOversized) {
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
	leave := s.attach(prefix, pub)
	<-ctx.Done()
	leave()
	return ctx.Err()
}

// Attach follows prefix for pub in watch mode without a goroutine of its
// own (source.Attacher): the member joins its group at once and leaves
// when detach is called. In poll mode, where each prefix is read by a
// loop of its own, it returns ok false.
func (s *Source) Attach(prefix string, pub source.Publisher) (detach func(), ok bool) {
	if s.cfg.ChangeDetection == Poll {
		return nil, false
	}
	return s.attach(prefix, pub), true
}

// attach makes a member of prefix join the grouping; the function it
// returns makes it leave.
func (s *Source) attach(prefix string, pub source.Publisher) (leave func()) {
	m := &member{prefix: prefix, pub: pub, log: s.log.With("prefix", prefix), bo: source.NewBackoff()}
	s.join(m)
	return func() { s.leave(m) }
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
