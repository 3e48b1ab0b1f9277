package source

import (
	"context"
	"sync"
)

// Fanout runs one loop for every Follow of a source that shares it — the
// HTTP source's poller, the Consul source's blocking queries (at most
// four) — so that the requests a source holds in flight do not grow with
// the prefixes its mounts follow. The first Join starts the loop, the last Leave stops it and waits
// for it, and Wake tells followers that the loop has news. A Fanout is safe
// for concurrent use.
type Fanout struct {
	run func(ctx context.Context)

	mu        sync.Mutex
	followers map[*Follower]struct{}
	cancel    context.CancelFunc
	done      chan struct{}
}

// Follower is one Follow registered with a Fanout.
type Follower struct {
	// Prefix is the prefix it follows.
	Prefix string
	// Wake receives a value when the loop has news; it holds one, so a
	// burst of news is one wake-up.
	Wake chan struct{}
}

// NewFanout returns a Fanout whose loop is run: it is called with a
// context that ends at the last Leave, and must return soon after.
func NewFanout(run func(ctx context.Context)) *Fanout {
	return &Fanout{run: run, followers: map[*Follower]struct{}{}}
}

// Join registers a follower of prefix and wakes it once, so that it reads
// what the loop already knows; the first Join starts the loop.
func (f *Fanout) Join(prefix string) *Follower {
	fl := &Follower{Prefix: prefix, Wake: make(chan struct{}, 1)}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.followers[fl] = struct{}{}
	fl.Wake <- struct{}{}
	if f.cancel == nil {
		ctx, cancel := context.WithCancel(context.Background())
		f.cancel, f.done = cancel, make(chan struct{})
		go func(done chan struct{}) {
			defer close(done)
			f.run(ctx)
		}(f.done)
	}
	return fl
}

// Leave unregisters fl; after the last follower it stops the loop and
// waits for it to return.
func (f *Fanout) Leave(fl *Follower) {
	f.mu.Lock()
	delete(f.followers, fl)
	if len(f.followers) > 0 {
		f.mu.Unlock()
		return
	}
	cancel, done := f.cancel, f.done
	f.cancel, f.done = nil, nil
	f.mu.Unlock()
	cancel()
	<-done
}

// Wake wakes every follower for which concerns returns true (every
// follower when concerns is nil), without blocking. concerns runs with the
// Fanout's lock held and must not call back into it.
func (f *Fanout) Wake(concerns func(*Follower) bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for fl := range f.followers {
		if concerns != nil && !concerns(fl) {
			continue
		}
		select {
		case fl.Wake <- struct{}{}:
		default:
		}
	}
}

// Prefixes returns the prefixes followed now, one per follower.
func (f *Fanout) Prefixes() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]string, 0, len(f.followers))
	for fl := range f.followers {
		out = append(out, fl.Prefix)
	}
	return out
}
