package etcd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sync/errgroup"

	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/source"
)

// Reading a group's prefixes: at the group's start and after a resync,
// each at one pinned revision; a member that joins a running group, or
// comes back from over its limits, at the latest. The reads run several at
// once and are published in batches (readPublisher says why).

// concurrentReads is how many of a group's prefixes are read at once when
// the group starts or re-reads: the start of a thousand mounts is not a
// thousand reads in a row.
const concurrentReads = 16

// memberRead is what a read of a member's prefix returned.
type memberRead struct {
	m         *member
	entries   kvset.Set
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

// readMembers reads ms at the latest revision, concurrentReads reads at
// once (readRuns), and publishes them: the group's events from then on are
// theirs, each from its read's revision (its floor). It returns an error
// other than a member's own limits, which ends the watch. With no member
// to read it returns at once: the group's watch calls it before every
// response, nearly always with none.
func (s *Source) readMembers(ctx context.Context, cli *clientv3.Client, ms []*member, revs *revisions) error {
	if len(ms) == 0 {
		return nil
	}
	var mu sync.Mutex // guards revs
	base := revs.seen
	pub := &readPublisher{}
	// Reads run at once and end in any order: each is checked against
	// what was seen before them all.
	check := func(h *etcdserverpb.ResponseHeader) error {
		mu.Lock()
		defer mu.Unlock()
		c := revisions{seen: base, cluster: revs.cluster}
		err := c.observe(h)
		revs.seen, revs.cluster = max(revs.seen, c.seen), c.cluster
		return err
	}
	if err := s.readRuns(ctx, cli, ms, 0, check, pub); err != nil {
		return err
	}
	pub.flush()
	return nil
}

// readRuns reads ms, sorted by prefix, at rev (0: each read at the
// latest revision), concurrentReads reads at once, and adds each member's
// read to pub; check, unless nil, is given each read's header before
// anything it read is added. The members are read in runs of up to
// spanMembers, as many runs as reads at once when they are fewer: a run
// of several as one span (readSpan), a run of one, or what a span gave
// up, one member at a time (readMemberAt). A member over its limits is
// held. It returns the first error other than a member's own limits.
func (s *Source) readRuns(ctx context.Context, cli *clientv3.Client, ms []*member, rev int64, check func(*etcdserverpb.ResponseHeader) error, pub *readPublisher) error {
	eg, ectx := errgroup.WithContext(ctx)
	eg.SetLimit(concurrentReads)
	per := min(spanMembers, (len(ms)+concurrentReads-1)/concurrentReads)
	if s.spansRefused.Load() {
		per = 1
	}
	for _, run := range spans(ms, per) {
		eg.Go(func() error {
			if len(run) > 1 {
				rest, err := s.readSpan(ectx, cli, run, rev, check, pub.add)
				switch {
				case errors.Is(err, errSpanRefused):
					if s.spansRefused.CompareAndSwap(false, true) {
						s.log.Warn("etcd refuses a read across the mounts' prefixes (authorization): each is read on its own from now on", "err", err)
					}
				case errors.Is(err, errSpanAbandoned):
					s.log.Debug("reading a span's prefixes one by one", "reason", err, "prefixes", len(rest))
				default:
					return err
				}
				run = rest
			}
			for _, m := range run {
				r, err := s.readMemberAt(ectx, cli, m, rev)
				if err != nil {
					return err
				}
				if r == nil {
					continue // held over its limits
				}
				if check != nil {
					if err := check(r.header); err != nil {
						return err
					}
				}
				pub.add(*r)
			}
			return nil
		})
	}
	return eg.Wait()
}
