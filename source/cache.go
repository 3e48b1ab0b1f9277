package source

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
)

// Feed is the shared state of one (source, prefix): the last snapshot and
// whether the source can currently be read. It implements Publisher for the
// source's follow. A Feed is safe for concurrent use.
type Feed struct {
	source string
	prefix string
	cache  *Cache

	mu       sync.Mutex
	snapshot *Snapshot
	err      error
	version  uint64

	// limits are those of each use (Acquire), under mu.
	limits map[Limits]int

	// Owned by the cache, under cache.mu.
	refs   int
	cancel context.CancelCauseFunc
	done   chan struct{}
}

// Limits returns the limits of every use of the feed merged
// (Limits.Merge): what the source may read and keep for the prefix.
func (f *Feed) Limits() Limits {
	f.mu.Lock()
	defer f.mu.Unlock()
	first, merged := true, Limits{}
	for l := range f.limits {
		if first {
			merged, first = l, false
			continue
		}
		merged = merged.Merge(l)
	}
	return merged
}

// FeedState is a Feed's state at one moment.
type FeedState struct {
	// Snapshot is the last snapshot, or nil before the first.
	Snapshot *Snapshot
	// Err is the last failure to read the source, or nil while it is
	// reachable. The snapshot stays in force meanwhile.
	Err error
	// Version increases with every change of Snapshot or Err.
	Version uint64
}

// State returns the feed's current state.
func (f *Feed) State() FeedState {
	f.mu.Lock()
	defer f.mu.Unlock()
	return FeedState{Snapshot: f.snapshot, Err: f.err, Version: f.version}
}

// Publish stores s as the feed's snapshot, clears any failure and wakes the
// cache's listener. Its revision is kept short and plain (BoundRevision).
// A value larger than the feed's Limits allow is not kept
// (its key goes to Snapshot.Oversized), and a snapshot over its key or byte
// bounds is not kept at all: the feed reports it as an error wrapping
// ErrOverLimits instead, and the last snapshot stays.
func (f *Feed) Publish(s Snapshot) {
	s.Revision = BoundRevision(s.Revision)
	s, err := f.Limits().apply(s)
	if err != nil {
		f.Status(fmt.Errorf("source %q prefix %q: %w", f.source, f.prefix, err))
		return
	}
	f.mu.Lock()
	f.snapshot = &s
	f.err = nil
	f.version++
	f.mu.Unlock()
	f.cache.markChanged(f)
}

// Status records the source's health for the feed and wakes the cache's
// listener when it changes.
func (f *Feed) Status(err error) {
	f.mu.Lock()
	if (err == nil) == (f.err == nil) && (err == nil || err.Error() == f.err.Error()) {
		f.mu.Unlock()
		return
	}
	f.err = err
	f.version++
	f.mu.Unlock()
	f.cache.markChanged(f)
}

type feedKey struct{ source, prefix string }

// Cache runs one follow per (source, prefix) that any mount uses,
// reference-counted: Acquire starts it, the last Release stops it.
type Cache struct {
	log     *slog.Logger
	changed func()

	mu      sync.Mutex
	sources map[string]Source
	feeds   map[feedKey]*Feed
	closed  bool

	// changedFeeds are the feeds whose state changed since the last
	// TakeChanged, under changedMu: a lock of its own, taken by Publish
	// and Status on the follows' goroutines, which SetSources and
	// Release wait for while they hold mu.
	changedMu    sync.Mutex
	changedFeeds map[*Feed]struct{}
}

// markChanged records that f's state changed, for TakeChanged, and wakes
// the cache's listener.
func (c *Cache) markChanged(f *Feed) {
	c.changedMu.Lock()
	if c.changedFeeds == nil {
		c.changedFeeds = map[*Feed]struct{}{}
	}
	c.changedFeeds[f] = struct{}{}
	c.changedMu.Unlock()
	c.changed()
}

// TakeChanged calls fn, without locks held, for each feed whose state
// changed (Publish, Status) since the last call, once each, and forgets
// them. A change recorded after it took the set wakes the listener again
// and is in the next call's. A feed whose last use was released since
// its change is not included: Release forgets it once its follow ended.
func (c *Cache) TakeChanged(fn func(*Feed)) {
	c.changedMu.Lock()
	taken := c.changedFeeds
	c.changedFeeds = nil
	c.changedMu.Unlock()
	for f := range taken {
		fn(f)
	}
}

// NewCache returns an empty cache. changed is called, without locks held,
// whenever any feed's state changes; it must not block (the reconciler's
// one-slot wake channel).
func NewCache(log *slog.Logger, changed func()) *Cache {
	return &Cache{log: log, changed: changed, sources: map[string]Source{}, feeds: map[feedKey]*Feed{}}
}

// SetSources makes sources the cache's sources. Feeds of a source whose
// instance changed are restarted on the new instance and keep their last
// snapshot meanwhile; the replaced and removed instances are closed, after
// their follows have ended.
func (c *Cache) SetSources(sources map[string]Source) {
	c.mu.Lock()
	var restart []*Feed
	var stopping []chan struct{}
	for key, f := range c.feeds {
		if sources[key.source] != c.sources[key.source] && f.cancel != nil {
			f.cancel(nil)
			stopping = append(stopping, f.done)
			restart = append(restart, f)
		}
	}
	old := c.sources
	c.sources = sources
	c.mu.Unlock()

	for _, done := range stopping {
		<-done
	}
	for name, s := range old {
		if sources[name] != s {
			if err := s.Close(); err != nil {
				c.log.Warn("closing source", "source", name, "err", err)
			}
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, f := range restart {
		f.cancel = nil
		if _, ok := c.sources[f.source]; ok && f.refs > 0 && !c.closed {
			c.start(f)
		} else if f.refs > 0 {
			f.Status(fmt.Errorf("source %q is no longer configured", f.source))
		}
	}
}

// Acquire returns the feed of (source, prefix) for a user whose mounts
// take at most lim, starting its follow when it is the first user. Each
// Acquire needs one Release with the same limits.
func (c *Cache) Acquire(source, prefix string, lim Limits) (*Feed, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errors.New("source: cache is closed")
	}
	if _, ok := c.sources[source]; !ok {
		return nil, fmt.Errorf("source: unknown source %q", source)
	}
	key := feedKey{source, prefix}
	f := c.feeds[key]
	if f == nil {
		f = &Feed{source: source, prefix: prefix, cache: c}
		c.feeds[key] = f
	}
	f.refs++
	f.mu.Lock()
	if f.limits == nil {
		f.limits = map[Limits]int{}
	}
	f.limits[lim]++
	f.mu.Unlock()
	if f.cancel == nil {
		c.start(f)
	}
	return f, nil
}

// ErrReleased is the cause (context.Cause) of the end of a follow whose
// last use was released: no mount follows the prefix any more — it was
// removed from the configuration, or an immutable mount has its payload. A
// source whose follow holds leases revokes them then (and not when the
// daemon stops or the source is replaced, whose follows end with another
// cause).
var ErrReleased = errors.New("no mount follows the prefix any more")

// Release gives up one use of f, acquired with lim; the last use stops its
// follow, with the cause ErrReleased.
func (c *Cache) Release(f *Feed, lim Limits) {
	c.mu.Lock()
	f.mu.Lock()
	if f.limits[lim]--; f.limits[lim] <= 0 {
		delete(f.limits, lim)
	}
	f.mu.Unlock()
	f.refs--
	if f.refs > 0 {
		c.mu.Unlock()
		return
	}
	delete(c.feeds, feedKey{f.source, f.prefix})
	cancel, done := f.cancel, f.done
	f.cancel = nil
	c.mu.Unlock()
	if cancel != nil {
		cancel(ErrReleased)
		<-done
	}
	// Its follow has ended: no change of it is recorded after this one
	// is forgotten.
	c.changedMu.Lock()
	delete(c.changedFeeds, f)
	c.changedMu.Unlock()
}

// Close stops every follow, waits for them, and closes every source.
func (c *Cache) Close() {
	c.mu.Lock()
	c.closed = true
	var dones []chan struct{}
	for _, f := range c.feeds {
		if f.cancel != nil {
			f.cancel(nil)
			dones = append(dones, f.done)
			f.cancel = nil
		}
	}
	sources := c.sources
	c.sources = map[string]Source{}
	c.mu.Unlock()
	for _, done := range dones {
		<-done
	}
	for name, s := range sources {
		if err := s.Close(); err != nil {
			c.log.Warn("closing source", "source", name, "err", err)
		}
	}
}

// start runs f's follow on its source: attached to it when the source is
// an Attacher that takes the prefix, else in a goroutine that the cache
// owns. c.mu must be held.
func (c *Cache) start(f *Feed) {
	src := c.sources[f.source]
	done := make(chan struct{})
	if a, ok := src.(Attacher); ok {
		if detach, ok := a.Attach(f.prefix, f); ok {
			// The follow ends as a Follow's would after its context's
			// end: asynchronously, done closed once it has.
			var once sync.Once
			f.cancel = func(error) {
				once.Do(func() {
					go func() {
						defer close(done)
						detach()
					}()
				})
			}
			f.done = done
			return
		}
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	f.cancel, f.done = cancel, done
	go func() {
		defer close(done)
		err := src.Follow(ctx, f.prefix, f)
		if ctx.Err() == nil {
			// Follow must not return early; report it and leave the
			// feed stale rather than spin.
			c.log.Error("source stopped following", "source", f.source, "prefix", f.prefix, "err", err)
			f.Status(fmt.Errorf("source %q stopped following %q: %v", f.source, f.prefix, err))
		}
	}()
}
