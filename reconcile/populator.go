package reconcile

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/source"
)

// FeedCache is what the populator needs of the source cache
// (*source.Cache, through NewPopulator): one shared feed per (source,
// prefix), acquired and released, and the sources replaced on reload.
type FeedCache interface {
	// Acquire returns the feed of (source, prefix); each needs a Release.
	Acquire(source, prefix string) (Feed, error)
	// Release gives up one use of f.
	Release(f Feed)
	// SetSources replaces the sources.
	SetSources(sources map[string]source.Source)
}

// Feed is one (source, prefix) as the populator reads it.
type Feed interface {
	// State returns the last snapshot and the source's health.
	State() source.FeedState
}

// sourceCache adapts *source.Cache to FeedCache.
type sourceCache struct{ c *source.Cache }

func (s sourceCache) Acquire(src, prefix string) (Feed, error) {
	f, err := s.c.Acquire(src, prefix)
	if err != nil {
		return nil, err
	}
	return f, nil
}

func (s sourceCache) Release(f Feed) { s.c.Release(f.(*source.Feed)) }

func (s sourceCache) SetSources(sources map[string]source.Source) { s.c.SetSources(sources) }

// Populator builds the desired state of world from the configured mounts
// and the snapshots of their feeds (the kubelet's
// desiredStateOfWorldPopulator). It holds one feed per projection from the
// source cache. It is not safe for concurrent use: the reconciler's loop
// owns it.
type Populator struct {
	cache  FeedCache
	log    *slog.Logger
	mounts map[string]*populated
	// generation numbers desired payloads; it only grows, across mounts.
	generation uint64
	// observer is told when a source's health or revision changes; the
	// Reconciler sets it.
	observer Observer
	// sources is the last health and revision reported per source.
	sources map[string]sourceState
	// dsw is the desired state Populate returns, updated in place; nil
	// when SetMounts changed the mounts, to be built anew.
	dsw DesiredState
}

// sourceState is what was last reported of a source.
type sourceState struct {
	err      string
	revision string
}

// populated is the populator's record of one mount.
type populated struct {
	spec  *config.Mount
	feeds []Feed // one per projection
	// snapshots and versions are the feed states the desired mount was
	// built from.
	snapshots []*source.Snapshot
	versions  []uint64
	desired   *DesiredMount
	// rejected holds the keys already reported as rejected, so each is
	// logged once.
	rejected map[string]bool
	// reported is the last payload error logged.
	reported string
	// stale is whether the mount was last logged as stale.
	stale bool
	// frozen is set once an immutable mount has its payload: its feeds
	// are released and its desired state no longer changes.
	frozen bool
	// renders lets templates whose inputs did not change skip rendering.
	renders projector.RenderCache
}

// NewPopulator returns a populator with no mounts, reading feeds from cache.
func NewPopulator(cache *source.Cache, log *slog.Logger) *Populator {
	return NewPopulatorFor(sourceCache{cache}, log)
}

// NewPopulatorFor returns a populator with no mounts, reading feeds from
// any FeedCache, such as a test's.
func NewPopulatorFor(cache FeedCache, log *slog.Logger) *Populator {
	return &Populator{cache: cache, log: log, mounts: map[string]*populated{}, observer: discardObserver{}, sources: map[string]sourceState{}}
}

// SetMounts makes mounts the configured mounts. A mount whose configuration
// is unchanged keeps its feeds and desired state untouched; a changed one is
// rebuilt, and so is an immutable one whose payload is frozen: a reload reads
// it again. Feeds no longer used are released. On error (a projection names
// a source the cache does not have) nothing changes.
func (p *Populator) SetMounts(mounts []*config.Mount) error {
	next := make(map[string]*populated, len(mounts))
	var acquired []Feed
	undo := func() {
		for _, f := range acquired {
			p.cache.Release(f)
		}
	}
	for _, m := range mounts {
		if old, ok := p.mounts[m.Name]; ok && reflect.DeepEqual(old.spec, m) && !old.frozen {
			next[m.Name] = old
			continue
		}
		pm := &populated{spec: m, rejected: map[string]bool{}}
		for _, pr := range m.Projections {
			f, err := p.cache.Acquire(pr.Source, pr.Prefix)
			if err != nil {
				undo()
				return fmt.Errorf("mount %q: %w", m.Name, err)
			}
			acquired = append(acquired, f)
			pm.feeds = append(pm.feeds, f)
		}
		pm.snapshots = make([]*source.Snapshot, len(pm.feeds))
		pm.versions = make([]uint64, len(pm.feeds))
		next[m.Name] = pm
	}
	for name, old := range p.mounts {
		if next[name] != old {
			for _, f := range old.feeds {
				p.cache.Release(f)
			}
		}
	}
	p.mounts = next
	p.dsw = nil
	return nil
}

// SetSources replaces the source cache's sources (see
// source.Cache.SetSources).
func (p *Populator) SetSources(sources map[string]source.Source) {
	p.cache.SetSources(sources)
}

// Close releases every feed.
func (p *Populator) Close() {
	_ = p.SetMounts(nil)
}

// Populate returns the desired state of world, rebuilding the payload of
// every mount whose feeds published a new snapshot since the last call.
// A mount whose feeds only changed health keeps its payload and generation.
// The map returned is the populator's own and is updated in place by the
// next call: read it before.
//
// It also tells the observer of each source whose health or newest
// revision changed (SourceEvent), as seen by the feeds in use.
func (p *Populator) Populate() DesiredState {
	fresh := p.dsw == nil
	if fresh {
		p.dsw = make(DesiredState, len(p.mounts))
	}
	changed := fresh
	for name, pm := range p.mounts {
		if p.populate(pm) || fresh {
			p.dsw[name] = pm.desired
			changed = true
		}
	}
	if changed {
		p.reportSources()
	}
	return p.dsw
}

// reportSources sends a SourceEvent for every source whose health or
// newest revision changed since the last call.
func (p *Populator) reportSources() {
	now := map[string]sourceState{}
	errs := map[string]error{}
	for _, pm := range p.mounts {
		for i, f := range pm.feeds {
			name := pm.spec.Projections[i].Source
			st := f.State()
			cur := now[name]
			if st.Err != nil && cur.err == "" {
				cur.err = st.Err.Error()
				errs[name] = st.Err
			}
			if st.Snapshot != nil && newerRevision(st.Snapshot.Revision, cur.revision) {
				cur.revision = st.Snapshot.Revision
			}
			now[name] = cur
		}
	}
	for name, cur := range now {
		if prev, ok := p.sources[name]; !ok || prev != cur {
			p.observer.Observe(SourceEvent{Source: name, Err: errs[name], Revision: cur.revision, Time: time.Now()})
		}
	}
	p.sources = now
}

// newerRevision reports whether revision a is newer than b: by numeric
// value for etcd revisions and Consul indexes (decimal strings), else any
// non-empty a replaces an empty b.
func newerRevision(a, b string) bool {
	if b == "" {
		return a != ""
	}
	if len(a) != len(b) {
		return len(a) > len(b) && strings.Trim(a, "0123456789") == ""
	}
	return a > b && strings.Trim(a, "0123456789") == ""
}

// populate brings pm's desired mount up to date with its feeds and reports
// whether any feed changed since the last call (pm.desired is then new).
func (p *Populator) populate(pm *populated) bool {
	if pm.frozen {
		return false
	}
	states := make([]source.FeedState, len(pm.feeds))
	changed, rebuild := pm.desired == nil, pm.desired == nil
	for i, f := range pm.feeds {
		states[i] = f.State()
		if states[i].Version != pm.versions[i] {
			changed = true
		}
		if states[i].Snapshot != pm.snapshots[i] {
			rebuild = true
		}
	}
	if !changed {
		return false
	}
	m := pm.spec
	d := &DesiredMount{Spec: m}
	var projections []projector.Projection
	var revisions []string
	for i, pr := range m.Projections {
		st := states[i]
		pm.versions[i] = st.Version
		pm.snapshots[i] = st.Snapshot
		if st.Err != nil {
			d.Stale = append(d.Stale, fmt.Errorf("source %q: %w", pr.Source, st.Err))
		}
		if st.Snapshot == nil {
			d.Waiting = append(d.Waiting, pr.Source)
			continue
		}
		revisions = append(revisions, pr.Source+"@"+st.Snapshot.Revision)
		pp := projector.Projection{
			Source: pr.Source, Prefix: pr.Prefix, Optional: pr.Optional,
			Missing: st.Snapshot.Missing, Entries: st.Snapshot.Entries,
		}
		if pr.Items != nil {
			pp.Items = make([]projector.Item, len(pr.Items))
			for j, it := range pr.Items {
				pp.Items[j] = projector.Item{Key: it.Key, Path: it.Path, Mode: it.Mode, Optional: it.Optional}
			}
		}
		projections = append(projections, pp)
	}
	d.Revision = strings.Join(revisions, ",")
	switch {
	case len(d.Waiting) > 0:
		d.Generation = 0
	case !rebuild && pm.desired != nil:
		// Only health changed: same payload, same generation.
		d.Payload, d.Err, d.Generation, d.Revision, d.ChangedAt = pm.desired.Payload, pm.desired.Err, pm.desired.Generation, pm.desired.Revision, pm.desired.ChangedAt
	default:
		p.generation++
		d.Generation = p.generation
		d.ChangedAt = time.Now()
		payload, rejected, err := projector.MakePayload(m.Name, projections, projector.Options{
			Mode: m.DefaultMode, UID: ownerID(m.UID, processUID), GID: ownerID(m.GID, processGID),
			MaxValueSize: m.MaxValueSize, MaxSize: m.MaxMountSize, MaxFiles: m.MaxFiles,
			Templates: m.Templates, KeysOnlyForTemplates: !m.KeysAsFiles, Renders: &pm.renders,
		})
		if err != nil {
			d.Err = err
			p.reportTooLarge(m.Name, d, err)
		} else {
			d.Payload = payload
		}
		p.reportRejected(pm, rejected)
	}
	p.reportState(pm, d)
	pm.desired = d
	if m.Immutable && d.Ready() {
		p.freeze(pm)
	}
	return true
}

// freeze stops following an immutable mount's sources once its payload is
// built (the kubelet stops watching immutable ConfigMaps and Secrets).
func (p *Populator) freeze(pm *populated) {
	for _, f := range pm.feeds {
		p.cache.Release(f)
	}
	pm.feeds, pm.snapshots, pm.versions = nil, nil, nil
	pm.frozen, pm.stale = true, false
	pm.desired = &DesiredMount{Spec: pm.desired.Spec, Payload: pm.desired.Payload, Generation: pm.desired.Generation, Revision: pm.desired.Revision, ChangedAt: pm.desired.ChangedAt}
	p.log.Info("immutable mount has its payload; no longer following its sources", "mount", pm.spec.Name, "revision", pm.desired.Revision)
}

// reportTooLarge tells the observer of a payload that max_value_size,
// max_mount_size or max_files kept from replacing the mount's content
// (HeldBackEvent);
// the log line comes from reportState.
func (p *Populator) reportTooLarge(mount string, d *DesiredMount, err error) {
	guard := ""
	switch {
	case errors.Is(err, projector.ErrValueTooLarge):
		guard = "max_value_size"
	case errors.Is(err, projector.ErrMountTooLarge):
		guard = "max_mount_size"
	case errors.Is(err, projector.ErrTooManyFiles):
		guard = "max_files"
	default:
		return
	}
	p.observer.Observe(HeldBackEvent{Mount: mount, Guard: guard, Reason: err.Error(), Revision: d.Revision, Time: d.ChangedAt})
}

// reportRejected logs each rejected key once, while it stays rejected.
func (p *Populator) reportRejected(pm *populated, rejected []*projector.KeyError) {
	now := make(map[string]bool, len(rejected))
	for _, r := range rejected {
		id := r.Source + "\x00" + r.Key
		now[id] = true
		if !pm.rejected[id] {
			p.log.Error("rejected key; the rest of the mount is projected", "mount", r.Mount, "source", r.Source, "key", r.Key, "err", r.Err)
		}
	}
	pm.rejected = now
}

// reportState logs a payload error once, and every change between stale
// and current.
func (p *Populator) reportState(pm *populated, d *DesiredMount) {
	log := p.log.With("mount", pm.spec.Name)
	errText := ""
	if d.Err != nil {
		errText = d.Err.Error()
	}
	if errText != pm.reported {
		if d.Err != nil {
			log.Error("cannot build mount payload; keeping last content", "err", d.Err)
		}
		pm.reported = errText
	}
	stale := len(d.Stale) > 0
	if stale != pm.stale {
		if stale {
			log.Warn("mount stale: source unreachable, keeping last content", "err", errorsText(d.Stale))
		} else {
			log.Info("mount current: sources reachable again")
		}
		pm.stale = stale
	}
}

func errorsText(errs []error) string {
	texts := make([]string, len(errs))
	for i, err := range errs {
		texts[i] = err.Error()
	}
	slices.Sort(texts)
	return strings.Join(texts, "; ")
}

// kvmount's own user and group, the owner of files when a mount names none.
var processUID, processGID = os.Geteuid(), os.Getegid()

// ownerID returns id, or def when id is -1 (not configured).
func ownerID(id, def int) int {
	if id < 0 {
		return def
	}
	return id
}
