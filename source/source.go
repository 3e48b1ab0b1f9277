// Package source defines what kvmount reads from: a Source follows key
// prefixes of one backend (etcd, Consul, an HTTP URL) and delivers a full
// Snapshot whenever one changes. The Cache shares one follow per (source,
// prefix) among all the mounts that use it, as the kubelet's object cache
// shares one watch among pods. Source kinds are registered in a Registry
// built by main.
package source

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/render"
)

// Snapshot is the complete set of keys under one prefix of one source at one
// revision. A Snapshot is immutable once published.
type Snapshot struct {
	// Revision is the source's version stamp: an etcd revision, a Consul
	// index, an HTTP ETag or body hash. It is for logs; equality of
	// Entries decides whether anything changed.
	Revision string
	// Missing reports that the prefix does not exist (no keys under it).
	Missing bool
	// Entries are the keys relative to the prefix and their values.
	Entries kvset.Set
	// Oversized maps the keys whose values were larger than the feed's
	// Limits.MaxValueSize to their sizes, in bytes: they exist, but their
	// bytes were not kept.
	Oversized map[string]int64
	// Secrets, from a source that reads whole secrets (Vault), are what a
	// template's secret function reads: each secret the entries came
	// from, by every path a template may name it with. A value the
	// source does not keep for its size (Oversized) is not in them
	// either. Nil for other sources.
	Secrets render.Secrets
}

// Publisher receives what a follow finds. The Cache's feeds implement it.
type Publisher interface {
	// Publish delivers a complete new snapshot. It also clears a failure
	// reported with Status.
	Publish(Snapshot)
	// Status reports the source's health for the prefix: a non-nil err
	// means it cannot currently be read and the last snapshot is stale; nil
	// means it is reachable again and the last snapshot is current.
	Status(err error)
	// Limits returns what the source may read and keep for the prefix
	// (see Limits); it changes as mounts start and stop following it.
	Limits() Limits
}

// Source is one configured backend.
type Source interface {
	// Follow reads prefix and follows it until ctx is done, publishing each
	// changed snapshot and each failure to pub. It retries failures itself
	// with jittered exponential backoff and never gives up; it returns
	// ctx's error once ctx is done, after its goroutines have ended.
	Follow(ctx context.Context, prefix string, pub Publisher) error
	// Close releases the source's connections. No Follow may be running.
	Close() error
}

// Attacher is a Source that can follow some prefixes without a goroutine
// of its own: one whose shared loops deliver to every prefix they cover,
// as the etcd source's grouped watches do. The Cache attaches a feed to
// such a source instead of running Follow in a goroutine that would only
// wait for its end — a parked goroutine's stack is at least 4 KiB once
// it has run (Go's stacks shrink only while a quarter is in use), 4 MB
// at 1,000 prefixes.
type Attacher interface {
	// Attach starts following prefix for pub, as Follow does, and returns
	// at once. It returns ok false, and starts nothing, when the source
	// follows prefix only with Follow (such as the etcd source in poll
	// mode). detach stops the following and returns once nothing more is
	// delivered to pub; the source retries failures meanwhile as Follow
	// does. detach is called once, and is not told why the following
	// ends: a source that acts on source.ErrReleased (revoking leases)
	// follows with Follow.
	Attach(prefix string, pub Publisher) (detach func(), ok bool)
}

// Kind is one kind of source, such as "etcd".
type Kind struct {
	// Name is the value of type in [sources.NAME].
	Name string
	// Decode reads and validates a [sources.NAME] table of this kind.
	Decode config.SourceDecoder
	// Open makes a Source from what Decode returned. It starts nothing;
	// Follow does.
	Open func(name string, settings any, env Env) (Source, error)
}

// Env is what every source is given besides its own settings, so that
// what kvmount hands its sources grows here, not in every Open's
// parameters. A source's health and snapshots reach the rest of kvmount
// through the Publisher of each Follow (the populator turns them into
// source events for metrics and status).
type Env struct {
	// Log is the source's logger, with the source's name attached.
	Log *slog.Logger
	// Files, when not nil, is where a source reads a credential file
	// again while it runs (a token a vault-agent sink rotates); nil reads
	// the disk. A worker's reads go to the monitor (privsep).
	Files config.Files
}

// Registry is the table of source kinds kvmount knows.
type Registry struct {
	kinds map[string]Kind
}

// NewRegistry returns a registry of kinds. It panics on a duplicate name: a
// programming error.
func NewRegistry(kinds ...Kind) *Registry {
	r := &Registry{kinds: map[string]Kind{}}
	for _, k := range kinds {
		if _, dup := r.kinds[k.Name]; dup {
			panic(fmt.Sprintf("source: kind %q registered twice", k.Name))
		}
		r.kinds[k.Name] = k
	}
	return r
}

// Decoders returns the decoder of every kind, for config.Load.
func (r *Registry) Decoders() map[string]config.SourceDecoder {
	out := make(map[string]config.SourceDecoder, len(r.kinds))
	for name, k := range r.kinds {
		out[name] = k.Decode
	}
	return out
}

// Names returns the kinds' names, sorted.
func (r *Registry) Names() []string {
	return slices.Sorted(maps.Keys(r.kinds))
}

// Open makes the Source that src configures; env.Log gets the source's
// name attached.
func (r *Registry) Open(src *config.Source, env Env) (Source, error) {
	k, ok := r.kinds[src.Type]
	if !ok {
		return nil, fmt.Errorf("source %q: unknown type %q; want one of %s", src.Name, src.Type, strings.Join(r.Names(), ", "))
	}
	env.Log = env.Log.With("source", src.Name)
	s, err := k.Open(src.Name, src.Settings, env)
	if err != nil {
		return nil, fmt.Errorf("source %q: %w", src.Name, err)
	}
	return s, nil
}
