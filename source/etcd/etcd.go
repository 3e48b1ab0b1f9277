// Package etcd is the etcd v3 source kind: it reads a key prefix at one
// revision, page by page, then watches it from that revision on, folding
// events into a map and publishing the whole map once per watch response —
// so the keys of one transaction switch together. Change detection "poll"
// re-reads the prefix every poll_interval instead (the kubelet's TTL cache
// strategy).
package etcd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/source"
)

// Defaults of a [sources.NAME] table of type "etcd".
const (
	DefaultEndpoint     = "http://127.0.0.1:2379"
	DefaultDialTimeout  = 5 * time.Second
	DefaultPollInterval = 30 * time.Second
)

const (
	// pageSize is how many keys one range request reads; a large prefix is
	// read in pages at one pinned revision (etcd client/v3/mirror). When
	// the feed bounds its values, a page's response is also bounded by
	// pageBudget bytes (listPrefix).
	pageSize = 1000
	// requestTimeout bounds one range request.
	requestTimeout = 10 * time.Second
	// maxRecvMsgSize bounds one gRPC message from etcd, in bytes: a page of
	// a read, a watch response. (The client's default is 2 GiB.) A watch
	// response larger than this — a transaction of many large values —
	// ends the watch, and the prefix is read anew in pages.
	maxRecvMsgSize = 64 << 20
	// pageBudget is what one page of a read may hold at most, in bytes,
	// when the feed bounds its values (source.Limits.MaxValueSize): the
	// most the gRPC client takes of the page's response, refused before
	// it is read into memory.
	pageBudget = 16 << 20
	// keepAliveTime is above the server's 5 s minimum
	// (--grpc-keepalive-min-time), or the server drops the connection.
	keepAliveTime    = 10 * time.Second
	keepAliveTimeout = 5 * time.Second
)

// Change detection strategies.
const (
	Watch = "watch"
	Poll  = "poll"
)

// Kind returns the etcd source kind for the registry.
func Kind() source.Kind {
	return source.Kind{Name: "etcd", Decode: Decode, Open: open}
}

func open(name string, settings any, env source.Env) (source.Source, error) {
	c, ok := settings.(*Config)
	if !ok {
		return nil, fmt.Errorf("source/etcd: settings are %T, not *etcd.Config", settings)
	}
	return New(name, c, env.Log)
}

// Source follows prefixes of one etcd cluster through one shared client.
type Source struct {
	name string
	cfg  *Config
	log  *slog.Logger

	mu      sync.Mutex
	client  *clientv3.Client
	monitor *monitor // of client's connection

	// refused is the error of the last connection the peer_user check
	// refused, nil once one passes: an unreachable etcd is reported with it.
	refused atomic.Pointer[error]

	// Watch mode (group.go): the members, one per Follow, sorted by
	// prefix; the groups, one watch each, by prefix; the pending
	// regrouping and the latest it may be put off to; the group prefixes
	// whose watch authorization refused; closed once Close ran.
	gmu             sync.Mutex
	members         []*member
	groups          map[string]*group
	regrouping      *time.Timer
	regroupBy       time.Time
	refusedPrefixes []string
	closed          bool
	// spansRefused is set once etcd refused a span's range for want of
	// permission (spanread.go): each prefix is read on its own from then
	// on.
	spansRefused atomic.Bool
}

var (
	_ source.Source   = (*Source)(nil)
	_ source.Attacher = (*Source)(nil)
)

// New returns a Source for cfg. It does not connect: the first Follow does,
// and retries until etcd answers, so kvmount starts while etcd is down.
func New(name string, cfg *Config, log *slog.Logger) (*Source, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("source/etcd: no endpoints")
	}
	return &Source{name: name, cfg: cfg, log: log, groups: map[string]*group{}}, nil
}

// Close stops the watches and closes the client.
func (s *Source) Close() error {
	s.gmu.Lock()
	s.closed = true
	if s.regrouping != nil {
		s.regrouping.Stop()
	}
	groups := s.groups
	s.groups = map[string]*group{}
	s.gmu.Unlock()
	for _, g := range groups {
		g.cancel()
		<-g.done
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.client == nil {
		return nil
	}
	s.monitor.stop()
	err := s.client.Close()
	s.client, s.monitor = nil, nil
	if err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("source/etcd: close: %w", err)
	}
	return nil
}

// testHookAfterList, when set by a test, runs between a read and the watch
// that follows it, to make the watch start from a compacted revision.
var testHookAfterList func()

// testHookAfterPage, when set by a test, runs after each page of a read
// but the last, to write while the read is under way.
var testHookAfterPage func()

// errResync ends a watch that must be replaced by a fresh read at once,
// such as after compaction (etcd ErrCompacted).
var errResync = errors.New("source/etcd: resync")

// Follow reads prefix and follows it until ctx is done; see source.Source.
// In watch mode it joins the watch of the group of prefixes that covers
// it (group.go): its prefix is read at one revision with the group's
// others, then followed from the group's watch, started from that
// revision with WithRequireLeader, so that a member that lost its leader
// ends the watch instead of hanging; a compacted or cancelled watch is
// replaced by a fresh read, and keys deleted meanwhile disappear because
// each read is a full snapshot. While the connection is in transient
// failure the prefix is reported stale. In poll mode it re-reads every
// poll interval (±10 %).
//
// Every response header (reads, watch responses, progress notifications,
// and a one-key read made each time the connection becomes ready again)
// is compared with the last one: a revision lower than one already seen,
// or a different cluster ID, means etcd lost its data or was restored from
// a snapshot without --bump-revision. The watch would then wait silently
// for a revision the new store reaches only much later, so the prefixes
// are read again and watched from the new revision.
func (s *Source) Follow(ctx context.Context, prefix string, pub source.Publisher) error {
	if s.cfg.ChangeDetection != Poll {
		return s.followWatched(ctx, prefix, pub)
	}
	f := &follower{src: s, prefix: prefix, pub: pub, log: s.log.With("prefix", prefix)}
	return f.run(ctx)
}

// follower is one Follow's state in poll mode.
type follower struct {
	src    *Source
	prefix string
	pub    source.Publisher
	log    *slog.Logger
	// last is the last snapshot published (published is false before
	// the first), and lastOversized its keys whose values were not kept.
	last          kvset.Set
	lastOversized map[string]int64
	published     bool
}

func (f *follower) run(ctx context.Context) error {
	bo := source.NewBackoff()
	for {
		err := f.cycle(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, errResync) {
			f.log.Info("re-reading prefix", "reason", err)
			continue
		}
		if err != nil {
			f.log.Warn("source unavailable, keeping last content", "err", err)
			f.pub.Status(err)
			if !source.Sleep(ctx, bo.NextBackOff()) {
				return ctx.Err()
			}
			continue
		}
		bo.Reset()
	}
}

// cycle reads the prefix once and publishes it, then waits one poll
// interval.
func (f *follower) cycle(ctx context.Context) error {
	cli, _, err := f.src.connect()
	if err != nil {
		return err
	}
	if err := f.src.ready(ctx, cli); err != nil {
		return err
	}
	entries, oversized, h, err := listPrefix(ctx, cli, f.prefix, f.pub.Limits(), 0)
	if errors.Is(err, rpctypes.ErrCompacted) {
		return fmt.Errorf("%w: revision compacted during read", errResync)
	}
	if err != nil {
		return err
	}
	f.publish(entries, oversized, h.Revision)
	source.Sleep(ctx, source.Jitter(f.src.cfg.PollInterval))
	return nil
}

// publish delivers entries and oversized (the keys whose values were not
// kept) unless they equal the last snapshot, in which case it only reports
// the source healthy.
func (f *follower) publish(entries kvset.Set, oversized map[string]int64, rev int64) {
	if f.published && kvset.Equal(entries, f.last) && maps.Equal(oversized, f.lastOversized) {
		f.pub.Status(nil)
		return
	}
	f.last, f.lastOversized, f.published = entries, oversized, true
	f.pub.Publish(source.Snapshot{Revision: strconv.FormatInt(rev, 10), Missing: entries.Len()+len(oversized) == 0, Entries: entries, Oversized: oversized})
}

// ready waits up to the dial timeout for the client's connection, so that
// an unreachable etcd is reported after dial_timeout rather than when a
// read that waits for the connection times out.
func (s *Source) ready(ctx context.Context, cli *clientv3.Client) error {
	conn := cli.ActiveConnection()
	wctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
	defer cancel()
	for state := conn.GetState(); state != connectivity.Ready; state = conn.GetState() {
		if state == connectivity.Idle {
			conn.Connect()
		}
		if !conn.WaitForStateChange(wctx, state) {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if refused := s.refused.Load(); refused != nil {
				return fmt.Errorf("source/etcd: %s unreachable: %w", strings.Join(s.cfg.Endpoints, ","), *refused)
			}
			return fmt.Errorf("source/etcd: %s unreachable: no connection within %v", strings.Join(s.cfg.Endpoints, ","), s.cfg.DialTimeout)
		}
	}
	return nil
}

// span returns the key range of prefix; the empty prefix is every key.
func span(prefix string) (key, end string) {
	if prefix == "" {
		return "\x00", "\x00"
	}
	return prefix, clientv3.GetPrefixRangeEnd(prefix)
}

// listPrefix reads every key under prefix at one revision — rev, or the
// latest when rev is 0 — in pages, and returns them relative to prefix
// with the header of the read that pinned the revision, bounded by lim
// (what the mounts following the prefix take at most): a value over
// lim.MaxValueSize is not kept but its key and size go to oversized; a
// prefix of more keys than lim.MaxKeys is refused by its count, before
// any value is kept; one of more bytes of values than lim.MaxBytes as soon
// as a page passes them; both with an error wrapping source.ErrOverLimits.
// The first request pins the revision the others read.
//
// The pages are sized by what they hold, which the gRPC client checks
// before it reads a response into memory (grpc.MaxCallRecvMsgSize), not
// by the most the values could hold. When lim bounds the keys, the first
// page asks for at most lim.MaxKeys+1 keys in at most firstPageBudget
// bytes; it carries the count. A first page refused for its size is
// followed by a request for the count alone, so that a prefix over the
// limit is refused with no value read. Then pages of pageSize keys in at
// most pageBudget bytes; a page refused for its size is asked again, and
// the rest of the read goes on, in as many keys as pageBudget holds at
// lim.MaxValueSize. Small values are so read a thousand to a request, not
// the 15 that 16 MiB hold at the default max_value_size of 1 MiB: 1,000
// prefixes of 100 small keys took 8,000 requests — a count, then 7 pages
// each — and a restart at that size 0.9–1.0 s; they now take 1,000.
func listPrefix(ctx context.Context, cli *clientv3.Client, prefix string, lim source.Limits, rev int64) (_ kvset.Set, oversized map[string]int64, header *etcdserverpb.ResponseHeader, err error) {
	var entries *kvset.Builder
	key, end := span(prefix)
	r := pageReader{kv: clientv3.RetryKVClient(cli), prefix: prefix, start: key, end: end, rev: rev, page: pageSize, safe: pageSize}
	budget := maxRecvMsgSize
	if lim.MaxValueSize > 0 {
		budget, r.safe = pageBudget, max(1, min(pageSize, pageBudget/(lim.MaxValueSize+1024)))
	}
	r.budget = budget
	counted := lim.MaxKeys <= 0
	if !counted {
		r.page, r.safe = min(r.page, int64(lim.MaxKeys)+1), min(r.safe, int64(lim.MaxKeys)+1)
		r.budget = min(budget, firstPageBudget)
	}
	var kept int64
	for {
		resp, err := r.read(ctx, key)
		if errors.Is(err, errPageTooLarge) {
			switch {
			case !counted:
				// Values too large for a first page: the count alone,
				// then pages of the usual budget.
				counted = true
				resp, err := r.count(ctx)
				if err != nil {
					return kvset.Set{}, nil, nil, err
				}
				header = resp.Header
				if err := lim.Check(int(resp.Count), 0); err != nil {
					return kvset.Set{}, nil, nil, fmt.Errorf("source/etcd: %s: %w", prefix, err)
				}
				r.budget = budget
				continue
			case r.page > r.safe:
				r.page = r.safe // the rest in pages that fit whatever the values
				continue
			}
		}
		if err != nil {
			return kvset.Set{}, nil, nil, fmt.Errorf("source/etcd: read %s: %w", prefix, err)
		}
		if header == nil {
			header = resp.Header
		}
		if entries == nil {
			counted, r.budget = true, budget
			if err := lim.Check(int(resp.Count), 0); err != nil {
				return kvset.Set{}, nil, nil, fmt.Errorf("source/etcd: %s: %w", prefix, err)
			}
			// Sized once for the whole range (Count, at most what a
			// few pages hold) rather than grown key by key.
			entries = kvset.NewBuilder(int(min(resp.Count, 4*pageSize)))
		}
		kept += addPacked(entries, &oversized, prefix, resp.Kvs, lim)
		if err := lim.Check(entries.Len()+len(oversized), kept); err != nil {
			return kvset.Set{}, nil, nil, fmt.Errorf("source/etcd: %s: %w", prefix, err)
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return entries.Set(), oversized, header, nil
		}
		if testHookAfterPage != nil {
			testHookAfterPage()
		}
		key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// firstPageBudget bounds the response of a read's first page, in bytes,
// when the mounts bound a prefix's keys: a prefix of many large values
// is counted before its values are read (listPrefix).
const firstPageBudget = 1 << 20

// errPageTooLarge is returned by pageReader.read for a page whose response
// passes its budget, or that the server refused as too many requests
// (both codes.ResourceExhausted): it is asked again in fewer keys.
var errPageTooLarge = errors.New("a page's response larger than its budget, or too many requests")

// pageReader reads the pages of one prefix — the keys from start to end —:
// at most page keys, in a response of at most budget bytes, at rev once
// pinned (0 before).
type pageReader struct {
	kv                 etcdserverpb.KVClient
	prefix, start, end string
	rev                int64
	page, safe         int64
	budget             int
}

// read returns the page from key, and pins the read's revision.
func (r *pageReader) read(ctx context.Context, key string) (*etcdserverpb.RangeResponse, error) {
	// clientv3's Get takes no gRPC call options: the pages go through its
	// KV client with the options its Get passes (it waits for a ready
	// connection), and the page's budget.
	rctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	resp, err := r.kv.Range(rctx, &etcdserverpb.RangeRequest{Key: []byte(key), RangeEnd: []byte(r.end), Limit: r.page, Revision: r.rev},
		grpc.WaitForReady(true), grpc.MaxCallRecvMsgSize(r.budget))
	if status.Code(err) == codes.ResourceExhausted {
		return nil, fmt.Errorf("%w (%v)", errPageTooLarge, err)
	}
	if err != nil {
		return nil, clientv3.ContextError(rctx, err) // as clientv3's Get returns it
	}
	if r.rev == 0 {
		r.rev = resp.Header.Revision
	}
	if testHookPageRead != nil {
		testHookPageRead(len(resp.Kvs))
	}
	return resp, nil
}

// testHookPageRead, when set by a test, is told the keys of each page
// read.
var testHookPageRead func(keys int)

// count returns the number of keys under the prefix alone, and pins the
// read's revision.
func (r *pageReader) count(ctx context.Context) (*etcdserverpb.RangeResponse, error) {
	rctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	resp, err := r.kv.Range(rctx, &etcdserverpb.RangeRequest{Key: []byte(r.start), RangeEnd: []byte(r.end), CountOnly: true, Revision: r.rev}, grpc.WaitForReady(true))
	if err != nil {
		return nil, fmt.Errorf("source/etcd: read %s: %w", r.prefix, clientv3.ContextError(rctx, err))
	}
	if r.rev == 0 {
		r.rev = resp.Header.Revision
	}
	return resp, nil
}

// addPacked adds kvs to entries under their keys relative to prefix, the
// page's values copied into one chunk of the set (kvset.Builder.Grow):
// kept one allocation per key and per value, as decoded, they shared
// size classes with the decoded messages, which are garbage at once, and
// the spans they left behind stayed resident, half empty — 1,000
// prefixes of 100 keys held that way left the heap in use about 18 MB
// above the live heap.
//
// A value lim does not keep is left out: its key and size go to
// *oversized (made when first needed). It returns the bytes of values
// kept.
func addPacked(entries *kvset.Builder, oversized *map[string]int64, prefix string, kvs []*mvccpb.KeyValue, lim source.Limits) int64 {
	p := []byte(prefix)
	rel := func(kv *mvccpb.KeyValue) []byte {
		return bytes.TrimPrefix(kv.Key, p)
	}
	kept := 0
	for _, kv := range kvs {
		if lim.Keeps(len(kv.Value)) {
			kept += len(kv.Value)
		}
	}
	entries.Grow(kept)
	for _, kv := range kvs {
		if !lim.Keeps(len(kv.Value)) {
			if *oversized == nil {
				*oversized = map[string]int64{}
			}
			(*oversized)[string(rel(kv))] = int64(len(kv.Value))
			continue
		}
		entries.AddBytes(rel(kv), kv.Value)
	}
	return int64(kept)
}

// apply folds events into entries and oversized (the keys whose values
// lim does not keep), and reports whether anything changed. entries and
// oversized themselves are never modified: they were published; the new
// set shares what entries' values it keeps (kvset.Set.With).
func apply(entries kvset.Set, oversized map[string]int64, prefix string, events []*clientv3.Event, lim source.Limits) (kvset.Set, map[string]int64, bool) {
	changes := make([]kvset.Change, 0, len(events))
	nextOversized, copied := oversized, false
	for _, ev := range events {
		rel := strings.TrimPrefix(string(ev.Kv.Key), prefix)
		size, hadOversized := nextOversized[rel]
		keep := ev.Type == clientv3.EventTypePut && lim.Keeps(len(ev.Kv.Value))
		oversizedNow := ev.Type == clientv3.EventTypePut && !keep
		if hadOversized != oversizedNow || oversizedNow && size != int64(len(ev.Kv.Value)) {
			if !copied {
				nextOversized, copied = maps.Clone(oversized), true
				if nextOversized == nil {
					nextOversized = map[string]int64{}
				}
			}
			if oversizedNow {
				nextOversized[rel] = int64(len(ev.Kv.Value))
			} else {
				delete(nextOversized, rel)
			}
		}
		if keep {
			changes = append(changes, kvset.Change{Key: rel, Value: ev.Kv.Value})
		} else {
			changes = append(changes, kvset.Change{Key: rel, Delete: true})
		}
	}
	next, changed := entries.With(changes)
	if copied && len(nextOversized) == 0 {
		nextOversized = nil
	}
	return next, nextOversized, changed || copied
}
