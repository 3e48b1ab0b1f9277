package consul

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/hashicorp/consul/api"
	"golang.org/x/time/rate"

	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/source"
)

// A Source follows all its prefixes with at most maxQueries blocking
// queries (one connection to the agent each), whatever their number. Each
// query reads a prefix that covers a group of them — the longest prefix the
// group has in common, all of KV when it has none — and each prefix's
// snapshot is split from that one response, so that it is consistent at one
// index. A default agent refuses more than 200 concurrent connections per
// client, which one query per prefix (or per key, as consul-template does)
// reaches at about 200 prefixes.
//
// The groups come from the prefixes' trie (source.Partition): prefixes that share
// less go to different queries, as long as there are queries to spare. A
// VM that follows "fleet/shared/" and "fleet/vm0042/" runs two queries,
// not one on "fleet/" that every other VM's keys would wake and fill; a
// thousand prefixes "p0000/" to "p0999/" (ten branches at their first
// difference) share one.
//
// A change anywhere under a query's prefix returns it; the response is
// sorted by key, so each follower finds its range by binary search, and a
// follower whose range has the same number of keys and the same highest
// ModifyIndex as before publishes nothing: a change costs a read of its
// group's prefix and the work of the prefixes it touched.

// maxQueries is the most blocking queries a Source runs at once.
const maxQueries = 4

// follower is one Follow's state, kept by the Source: what it last
// published, so that an unchanged range publishes nothing.
type follower struct {
	prefix    string
	pub       source.Publisher
	fl        *source.Follower // its registration with the fanout
	published bool
	sig       signature
	errText   string // the error last reported; "" when healthy
}

// listing is the outcome of one group's query: the pairs under parent,
// sorted by key, at index; or the error of the last failed query.
type listing struct {
	parent string
	pairs  api.KVPairs
	index  uint64
	err    error
}

// Never backwards. A read answered by a server that lags — a follower in
// stale mode, a survivor after the loss of the leader, a query started
// afresh after an error — may carry a lower index than one already
// published, and with it older values: a mount would go back in time. A
// snapshot restore lowers the index too, and must be followed. So a
// group's highest published index is kept (Source.highest), and an answer
// below it is published only once a consistent read (the leader,
// confirming its leadership with a quorum) confirms that the store went
// back; until then the group's followers are stale.

// join registers a follower of prefix and then joins the shared watcher
// (the first starts it): registered first, it is handed the very first
// listing. It is also handed what its group's query already knows, and
// the queries are grouped anew when none covers prefix.
func (s *Source) join(prefix string, pub source.Publisher) *follower {
	st := &follower{prefix: prefix, pub: pub}
	s.mu.Lock()
	i, _ := slices.BinarySearchFunc(s.followers, prefix, func(f *follower, p string) int { return strings.Compare(f.prefix, p) })
	s.followers = slices.Insert(s.followers, i, st)
	s.mu.Unlock()
	st.fl = s.fanout.Join(prefix)
	s.mu.Lock()
	defer s.mu.Unlock()
	if l := s.listingFor(prefix); l != nil {
		s.deliver(st, l, rangeOf(l.pairs, prefix))
	}
	if _, ok := source.CoveringGroup(s.groups, prefix); !ok && s.regroup != nil {
		s.regroup()
	}
	return st
}

// leave unregisters st; the last one stops the watcher. A group that loses
// its last follower is dropped: the queries are grouped anew.
func (s *Source) leave(st *follower) {
	s.mu.Lock()
	s.followers = slices.DeleteFunc(s.followers, func(f *follower) bool { return f == st })
	s.mu.Unlock()
	s.fanout.Leave(st.fl) // before grouping anew, which reads the fanout's prefixes
	s.mu.Lock()
	defer s.mu.Unlock()
	if g, ok := source.CoveringGroup(s.groups, st.prefix); ok && s.regroup != nil && !s.groupFollowed(g) {
		s.regroup()
	}
}

// groupFollowed reports whether a follower's prefix lies in group g.
// Callers hold s.mu.
func (s *Source) groupFollowed(g string) bool {
	lo, hi := s.followersIn(g)
	return lo < hi
}

// followersIn returns the bounds in s.followers of those whose prefix
// starts with g: prefixes sorted, they are contiguous. Callers hold s.mu.
func (s *Source) followersIn(g string) (lo, hi int) {
	lo = sort.Search(len(s.followers), func(i int) bool { return s.followers[i].prefix >= g })
	hi = lo + sort.Search(len(s.followers)-lo, func(i int) bool { return !strings.HasPrefix(s.followers[lo+i].prefix, g) })
	return lo, hi
}

// listingFor returns the listing of the query that covers prefix, or nil
// before it has answered. Callers hold s.mu.
func (s *Source) listingFor(prefix string) *listing {
	g, ok := source.CoveringGroup(s.groups, prefix)
	if !ok {
		return nil
	}
	return s.lists[g]
}

// set records a listing and hands it to the followers of its group, on
// the query's goroutine: a change reaches the feeds without another
// goroutine's wake-up in between.
func (s *Source) set(l *listing) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !slices.Contains(s.groups, l.parent) {
		return // the last answer of a query regrouped away
	}
	if l.err != nil {
		if prev := s.lists[l.parent]; prev != nil {
			// Keep the last pairs; report the error.
			kept := *prev
			kept.err = l.err
			l = &kept
		}
	}
	s.lists[l.parent] = l
	if l.err == nil {
		s.highest[l.parent] = l.index
	}
	if s.unhealthy != nil {
		// The liveness probe fails: what the query read is kept, and
		// published once it passes (the queries then read afresh).
		lo, hi := s.followersIn(l.parent)
		for _, st := range s.followers[lo:hi] {
			if text := s.unhealthy.Error(); st.errText != text {
				st.pub.Status(s.unhealthy)
				st.errText = text
			}
		}
		return
	}
	// The group's followers and the pairs are both sorted by key: one walk
	// over the two finds each follower's range. For a thousand followers
	// of a thousand keys that takes 0.03 ms per change; a binary search
	// per follower took 0.25–0.28 ms (BenchmarkSplit).
	lo, hi := s.followersIn(l.parent)
	next := 0 // the first pair that may start the next follower's range
	for _, st := range s.followers[lo:hi] {
		next = seek(l.pairs, next, st.prefix)
		end := next
		for end < len(l.pairs) && strings.HasPrefix(l.pairs[end].Key, st.prefix) {
			end++
		}
		s.deliver(st, l, l.pairs[next:end])
	}
}

// seek returns the index of the first pair at or after from whose key is
// not below key; pairs is sorted. It steps when that pair is near, and
// searches when it is far.
func seek(pairs api.KVPairs, from int, key string) int {
	for i := from; i < len(pairs) && i < from+8; i++ {
		if pairs[i].Key >= key {
			return i
		}
	}
	return from + sort.Search(len(pairs)-from, func(i int) bool { return pairs[from+i].Key >= key })
}

// deliver hands st its part of l, own (the pairs under its prefix): an
// error it has not reported yet; else a snapshot when its range changed
// (its key count or highest ModifyIndex) or was never published; else,
// after an error, that the source is healthy again. Each snapshot is the
// prefix's part of one response, consistent at its index; a prefix without
// keys is missing. Callers hold s.mu.
func (s *Source) deliver(st *follower, l *listing, own api.KVPairs) {
	if l.err != nil {
		if text := l.err.Error(); text != st.errText {
			st.pub.Status(l.err)
			st.errText = text
		}
		return
	}
	sig := signatureOf(own)
	if st.published && sig == st.sig {
		if st.errText != "" {
			st.pub.Status(nil) // reachable again, nothing new for this prefix
			st.errText = ""
		}
		return
	}
	// The values copied into one chunk: the response's, one allocation
	// each, are garbage once every prefix has its part.
	b := kvset.NewBuilder(len(own))
	size := 0
	for _, p := range own {
		size += len(p.Value)
	}
	b.Grow(size)
	for _, p := range own {
		b.Add(strings.TrimPrefix(p.Key, st.prefix), p.Value)
	}
	st.pub.Publish(source.Snapshot{Revision: strconv.FormatUint(l.index, 10), Missing: len(own) == 0, Entries: b.Set()})
	st.published, st.sig, st.errText = true, sig, ""
}

// watch runs the groups' queries until ctx is done, and runs them anew,
// grouped again, whenever a follower joins that no query covers.
func (s *Source) watch(ctx context.Context) {
	defer func() {
		s.mu.Lock()
		s.groups, s.lists, s.regroup, s.unhealthy = nil, map[string]*listing{}, nil, nil
		s.mu.Unlock()
	}()
	if s.cfg.ChangeDetection == Watch {
		var probing sync.WaitGroup
		probing.Go(func() { s.liveness(ctx) })
		defer probing.Wait()
	}
	for ctx.Err() == nil {
		groups := source.Partition(s.fanout.Prefixes(), maxQueries)
		gctx, cancel := context.WithCancel(ctx)
		s.mu.Lock()
		s.groups, s.regroup = groups, cancel
		for parent := range s.lists {
			if !slices.Contains(groups, parent) {
				delete(s.lists, parent)
			}
		}
		for parent := range s.highest {
			if !slices.Contains(groups, parent) {
				delete(s.highest, parent)
			}
		}
		s.mu.Unlock()
		// A follower that joined after the partition and checked the
		// groups before they were set is not covered: group again.
		for _, p := range s.fanout.Prefixes() {
			if _, ok := source.CoveringGroup(groups, p); !ok {
				cancel()
			}
		}
		var wg sync.WaitGroup
		for _, parent := range groups {
			wg.Go(func() { s.query(gctx, parent) })
		}
		<-gctx.Done()
		wg.Wait()
		cancel()
	}
}

// query runs the blocking query of one group until ctx is done, by
// Consul's rules for blocking queries: the index starts at 0 and is reset
// to 0 when it goes backwards and after a failed query; it is never sent
// below 1; returns without a change are rate-limited (a burst of 5, then
// one per 15 s). A return without a change is confirmed with a
// non-blocking read, so that a store whose index went backwards (a
// snapshot restore, whose parked queries return with their old index) is
// read again at once, not after wait; an answer below the group's highest
// published index is confirmed by a consistent read first (never
// backwards). In poll mode it reads parent every poll_interval instead.
func (s *Source) query(ctx context.Context, parent string) {
	bo := source.NewBackoff()
	idle := rate.NewLimiter(rate.Every(idleEvery), idleBurst)
	var index uint64
	for {
		if s.cfg.ChangeDetection == Poll {
			index = 0
		}
		lctx := withBodyLimit(ctx, s.groupLimit(parent))
		pairs, meta, err := s.list(lctx, parent, index, s.cfg.Consistency)
		unchanged := err == nil && index != 0 && meta.LastIndex == index
		if unchanged {
			pairs, meta, err = s.list(lctx, parent, 0, s.cfg.Consistency)
			unchanged = err == nil && meta.LastIndex == index
		}
		if highest := s.highestOf(parent); err == nil && meta.LastIndex < highest {
			pairs, meta, err = s.confirm(lctx, parent, meta.LastIndex, highest)
		}
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			s.log.Warn("source unavailable, keeping last content", "prefix", parent, "err", err)
			s.set(&listing{parent: parent, err: err})
			index = 0
			if !s.backOff(ctx, bo.NextBackOff(), err) {
				return
			}
			continue
		}
		bo.Reset()
		if !sort.SliceIsSorted(pairs, func(i, j int) bool { return pairs[i].Key < pairs[j].Key }) {
			slices.SortFunc(pairs, func(a, b *api.KVPair) int { return strings.Compare(a.Key, b.Key) })
		}
		s.set(&listing{parent: parent, pairs: pairs, index: meta.LastIndex})
		if s.cfg.ChangeDetection == Poll {
			if !source.Sleep(ctx, source.Jitter(s.cfg.PollInterval)) {
				return
			}
			continue
		}
		index = nextIndex(index, meta.LastIndex)
		// Let the change just published go first: the populator's
		// goroutine builds its payload and sends it on while this one
		// would otherwise write the next blocking query — one more
		// wake-up of the agent, and the query's write, ahead of the
		// change on a worker with one CPU (its GOMAXPROCS).
		runtime.Gosched()
		if unchanged {
			if err := idle.Wait(ctx); err != nil {
				return
			}
		}
	}
}

// highestOf returns the highest index published for the group parent.
func (s *Source) highestOf(parent string) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.highest[parent]
}

// confirm reads parent with a consistent read after an answer at index,
// below highest, the highest published: the consistent read's answer is
// the store's, a restore's lower index included, where the first may have
// come from a server that lags.
func (s *Source) confirm(ctx context.Context, parent string, index, highest uint64) (api.KVPairs, *api.QueryMeta, error) {
	pairs, meta, err := s.list(ctx, parent, 0, ConsistencyConsistent)
	switch {
	case err != nil:
		return nil, nil, fmt.Errorf("an answer at index %d, below %d already published, cannot be confirmed: %w", index, highest, err)
	case meta.LastIndex < highest:
		s.log.Warn("the index went back, and a consistent read confirms it: the store was restored or lost data; following it",
			"prefix", parent, "index", meta.LastIndex, "published", highest)
	default:
		s.log.Info("an answer from a server that lags was left out; a consistent read is newer", "prefix", parent,
			"lagging", index, "index", meta.LastIndex)
	}
	return pairs, meta, nil
}

// groupLimit returns the most bytes of a response to the query of group g
// (whose followers' prefixes start with it), from what the mounts following
// those prefixes take at most (source.Limits): per follower its bytes of
// values, base64-encoded, and for each key room for its JSON (key, flags,
// indexes); 0, no bound, when a follower bounds neither keys nor bytes —
// its mount takes whatever the prefix holds. Keys of g no follower reads
// count against it too: a store writer who fills them makes the query
// fail, and its followers stale, not kvmount's memory grow.
func (s *Source) groupLimit(g string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	lo, hi := s.followersIn(g)
	var total int64
	for _, st := range s.followers[lo:hi] {
		lim := st.pub.Limits()
		if lim.MaxKeys == 0 || lim.MaxBytes == 0 {
			return 0
		}
		total += lim.MaxBytes*4/3 + int64(lim.MaxKeys)*perKeyJSON
	}
	return total + 64<<10
}

// perKeyJSON is what a key costs in a listing's JSON beside its value, in
// bytes: its name (at most 512 in Consul) and its fields.
const perKeyJSON = 1024

// rangeOf returns the pairs whose keys start with prefix; pairs is sorted.
func rangeOf(pairs api.KVPairs, prefix string) api.KVPairs {
	lo := sort.Search(len(pairs), func(i int) bool { return pairs[i].Key >= prefix })
	hi := lo + sort.Search(len(pairs)-lo, func(i int) bool { return !strings.HasPrefix(pairs[lo+i].Key, prefix) })
	return pairs[lo:hi]
}

// signature sums up a range of pairs: a range with the same number of keys
// and the same highest ModifyIndex holds the same keys and values (an
// update raises the index, a deletion lowers the count, a deletion with an
// addition raises the index).
type signature struct {
	count    int
	maxIndex uint64
}

func signatureOf(pairs api.KVPairs) signature {
	sig := signature{count: len(pairs)}
	for _, p := range pairs {
		sig.maxIndex = max(sig.maxIndex, p.ModifyIndex)
	}
	return sig
}

// Follow follows prefix through the source's shared queries until ctx is
// done; see source.Source and the package documentation. Its snapshots
// are published by the query of its group.
func (s *Source) Follow(ctx context.Context, prefix string, pub source.Publisher) error {
	st := s.join(prefix, pub)
	defer s.leave(st)
	<-ctx.Done()
	return ctx.Err()
}
