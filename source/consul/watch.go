package consul

import (
	"context"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/hashicorp/consul/api"
	"golang.org/x/time/rate"

	"github.com/kvmount/kvmount/source"
)

// A Source follows all its prefixes with one blocking query (one
// connection to the agent), whatever their number: the query reads the
// longest prefix they have in common (all of KV when they have none) and
// each prefix's snapshot is split from that one response, so that it is
// consistent at one index. A default agent refuses more than 200
// concurrent connections per client, which one query per prefix (or per
// key, as consul-template does) reaches at about 200 prefixes.
//
// A change anywhere under the common prefix returns the query; the
// response is sorted by key, so each follower finds its range by binary
// search, and a follower whose range has the same number of keys and the
// same highest ModifyIndex as before publishes nothing: a change costs a
// read of the common prefix and the work of the prefixes it touched.

// seen is what the watcher last woke a follower for: whether it was
// woken for a listing, and what that listing showed of its prefix.
type seen struct {
	woken   bool
	sig     signature
	errText string
}

// listing is the outcome of the shared query: the pairs under parent,
// sorted by key, at index; or the error of the last failed query.
type listing struct {
	parent string
	pairs  api.KVPairs
	index  uint64
	err    error
}

// join registers a follower of prefix with the shared watcher (the first
// starts it) and restarts the query when prefix widens the common prefix.
func (s *Source) join(prefix string) *source.Follower {
	f := s.fanout.Join(prefix) // woken once: it reads what is known
	s.mu.Lock()
	defer s.mu.Unlock()
	if (s.last == nil || !strings.HasPrefix(prefix, s.last.parent)) && s.requery != nil {
		s.requery() // widen the query at once
	}
	return f
}

// leave unregisters f; the last one stops the watcher.
func (s *Source) leave(f *source.Follower) {
	s.mu.Lock()
	delete(s.seen, f)
	s.mu.Unlock()
	s.fanout.Leave(f)
	s.mu.Lock()
	if len(s.fanout.Prefixes()) == 0 {
		s.last = nil
	}
	s.mu.Unlock()
}

// parent returns the longest prefix common to every follower's prefix.
func (s *Source) parent() string {
	prefixes := s.fanout.Prefixes()
	if len(prefixes) == 0 {
		return ""
	}
	common := prefixes[0]
	for _, p := range prefixes[1:] {
		n := 0
		for n < len(common) && n < len(p) && common[n] == p[n] {
			n++
		}
		common = common[:n]
	}
	return common
}

// set records a listing and wakes the followers it concerns: those whose
// range changed (its key count or highest ModifyIndex), whose error state
// changed, or that have not been woken yet. The others have nothing new.
func (s *Source) set(l *listing) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l.err != nil && s.last != nil {
		// Keep the last pairs; report the error.
		prev := *s.last
		prev.err = l.err
		l = &prev
	}
	s.last = l
	errText := ""
	if l.err != nil {
		errText = l.err.Error()
	}
	s.fanout.Wake(func(f *source.Follower) bool {
		if !strings.HasPrefix(f.Prefix, l.parent) {
			return false
		}
		sig := signatureOf(rangeOf(l.pairs, f.Prefix))
		if last := s.seen[f]; last.woken && last.sig == sig && last.errText == errText {
			return false
		}
		s.seen[f] = seen{woken: true, sig: sig, errText: errText}
		return true
	})
}

// watch runs the shared query until ctx is done, by Consul's rules for
// blocking queries: the index is reset to 0 when it goes backwards, after
// a failed query and when the common prefix changes; it is never sent
// below 1; returns without a change are rate-limited (a burst of 5, then
// one per 15 s). In poll mode it reads the common prefix every
// poll_interval instead.
func (s *Source) watch(ctx context.Context) {
	bo := source.NewBackoff()
	idle := rate.NewLimiter(rate.Every(idleEvery), idleBurst)
	var index uint64
	lastParent := ""
	first := true
	for {
		parent := s.parent()
		if first || parent != lastParent || s.cfg.ChangeDetection == Poll {
			index = 0
		}
		first, lastParent = false, parent
		qctx, cancel := context.WithCancel(ctx)
		s.mu.Lock()
		s.requery = cancel
		s.mu.Unlock()
		pairs, meta, err := s.list(qctx, parent, index)
		requeried := qctx.Err() != nil && ctx.Err() == nil
		cancel()
		s.mu.Lock()
		s.requery = nil
		s.mu.Unlock()
		switch {
		case ctx.Err() != nil:
			return
		case requeried:
			continue // the followers changed: query the new common prefix
		case err != nil:
			s.log.Warn("source unavailable, keeping last content", "prefix", parent, "err", err)
			s.set(&listing{parent: parent, err: err})
			index = 0
			if !source.Sleep(ctx, bo.NextBackOff()) {
				return
			}
			continue
		}
		bo.Reset()
		if !sort.SliceIsSorted(pairs, func(i, j int) bool { return pairs[i].Key < pairs[j].Key }) {
			slices.SortFunc(pairs, func(a, b *api.KVPair) int { return strings.Compare(a.Key, b.Key) })
		}
		unchanged := index != 0 && meta.LastIndex == index
		s.set(&listing{parent: parent, pairs: pairs, index: meta.LastIndex})
		if s.cfg.ChangeDetection == Poll {
			if !source.Sleep(ctx, source.Jitter(s.cfg.PollInterval)) {
				return
			}
			continue
		}
		index = nextIndex(index, meta.LastIndex)
		if unchanged {
			if err := idle.Wait(ctx); err != nil {
				return
			}
		}
	}
}

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

// Follow follows prefix through the source's shared query until ctx is
// done; see source.Source and the package documentation. Each snapshot is
// the prefix's part of one response, consistent at its index; a prefix
// without keys is missing.
func (s *Source) Follow(ctx context.Context, prefix string, pub source.Publisher) error {
	f := s.join(prefix)
	defer s.leave(f)
	var lastSig signature
	var lastErr error
	published := false
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-f.Wake:
		}
		s.mu.Lock()
		l := s.last
		s.mu.Unlock()
		if l == nil || !strings.HasPrefix(prefix, l.parent) {
			continue // a query covering this prefix is on its way
		}
		if l.err != nil {
			if lastErr == nil || lastErr.Error() != l.err.Error() {
				pub.Status(l.err)
				lastErr = l.err
			}
			continue
		}
		own := rangeOf(l.pairs, prefix)
		sig := signatureOf(own)
		if published && sig == lastSig {
			pub.Status(nil) // reachable, nothing new for this prefix
			lastErr = nil
			continue
		}
		entries := make(map[string][]byte, len(own))
		for _, p := range own {
			entries[strings.TrimPrefix(p.Key, prefix)] = p.Value
		}
		pub.Publish(source.Snapshot{Revision: strconv.FormatUint(l.index, 10), Missing: len(own) == 0, Entries: entries})
		published, lastSig, lastErr = true, sig, nil
	}
}
