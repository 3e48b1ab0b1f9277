package reconcile

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/source"
)

// FeedCache is what the populator needs of the source cache
// (*source.Cache, through NewPopulator): one shared feed per (source,
// prefix), acquired and released, and the sources replaced on reload.
type FeedCache interface {
	// Acquire returns the feed of (source, prefix) for a use that takes at
	// most lim; each needs a Release with the same limits.
	Acquire(source, prefix string, lim source.Limits) (Feed, error)
	// Release gives up one use of f, acquired with lim.
	Release(f Feed, lim source.Limits)
	// SetSources replaces the sources.
	SetSources(sources map[string]source.Source)
	// TakeChanged calls fn for each feed whose state changed since the
	// last call, and forgets them (source.Cache.TakeChanged). A change
	// after it took them is in the next call's, and wakes the loop.
	TakeChanged(fn func(Feed))
}

// Feed is one (source, prefix) as the populator reads it.
type Feed interface {
	// State returns the last snapshot and the source's health.
	State() source.FeedState
}

// sourceCache adapts *source.Cache to FeedCache.
type sourceCache struct{ c *source.Cache }

func (s sourceCache) Acquire(src, prefix string, lim source.Limits) (Feed, error) {
	f, err := s.c.Acquire(src, prefix, lim)
	if err != nil {
		return nil, err
	}
	return f, nil
}

func (s sourceCache) Release(f Feed, lim source.Limits) { s.c.Release(f.(*source.Feed), lim) }

// limitsOf returns what the feeds of projection pr of mount m need to read
// and keep at most (source.Limits): no value over max_value_size; for a
// projection whose keys become files without items, no more than twice as
// many keys as max_files and twice as many bytes as max_mount_size (else
// max_files × max_value_size) — a payload just over the mount's own limits
// still reaches MakePayload, which holds it back naming the limit and
// counts it (kvmount_guard_rejections_total); a prefix far beyond them is
// not read. A projection with items, or whose keys feed templates only,
// may hold any number of other keys: those bounds do not apply.
func limitsOf(m *config.Mount, pr config.Projection) source.Limits {
	l := source.Limits{MaxValueSize: m.MaxValueSize}
	if m.KeysAsFiles && pr.Items == nil {
		l.MaxKeys, l.MaxBytes = 2*m.MaxFiles, 2*m.MaxMountSize
		if l.MaxBytes == 0 && m.MaxValueSize > 0 {
			l.MaxBytes = 2 * int64(m.MaxFiles) * m.MaxValueSize
		}
	}
	return l
}

func (s sourceCache) SetSources(sources map[string]source.Source) { s.c.SetSources(sources) }

func (s sourceCache) TakeChanged(fn func(Feed)) { s.c.TakeChanged(func(f *source.Feed) { fn(f) }) }

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
	// wake is called when a build that runs off the loop ends, so that
	// the next Populate takes its result; builds counts those running.
	wake   func()
	builds sync.WaitGroup
	// users maps each feed in use to its source and the mounts it feeds,
	// and bySource each source to its feeds in use; nil until the next
	// Populate indexes them anew (after SetMounts, or a freeze).
	users    map[Feed]*feedUse
	bySource map[string][]Feed
	// due are the mounts the next Populate visits whatever their feeds
	// did: those that Rebuild named, and those building off the loop.
	due map[*populated]struct{}
	// changedFeeds are the feeds TakeChanged gave this Populate, through
	// takeChanged; sourcesOf is reportSourcesOf's scratch. Kept, so that
	// an update allocates neither.
	changedFeeds []Feed
	takeChanged  func(Feed)
	sourcesOf    map[string]sourceState
	// changed are the mounts the last Populate put anew into dsw, and
	// rebuilt whether it built dsw anew instead (Changed).
	changed []string
	rebuilt bool
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
	// A build in progress owns it.
	renders projector.RenderCache
	// building is set while a build of this mount's payload runs off the
	// loop (a mount with templates: see buildAsync); built receives its
	// result, and since it started, the feeds published newer snapshots
	// when stale is set.
	building bool
	built    chan built
}

// NewPopulator returns a populator with no mounts, reading feeds from cache.
func NewPopulator(cache *source.Cache, log *slog.Logger) *Populator {
	return NewPopulatorFor(sourceCache{cache}, log)
}

// NewPopulatorFor returns a populator with no mounts, reading feeds from
// any FeedCache, such as a test's.
func NewPopulatorFor(cache FeedCache, log *slog.Logger) *Populator {
	return &Populator{cache: cache, log: log, mounts: map[string]*populated{}, observer: discardObserver{}, sources: map[string]sourceState{},
		due: map[*populated]struct{}{}}
}

// SetMounts makes mounts the configured mounts. A mount whose configuration
// is unchanged keeps its feeds and desired state untouched; a changed one is
// rebuilt, and so is an immutable one whose payload is frozen: a reload reads
// it again. Feeds no longer used are released. On error (a projection names
// a source the cache does not have) nothing changes.
func (p *Populator) SetMounts(mounts []*config.Mount) error {
	next := make(map[string]*populated, len(mounts))
	type use struct {
		f   Feed
		lim source.Limits
	}
	var acquired []use
	undo := func() {
		for _, u := range acquired {
			p.cache.Release(u.f, u.lim)
		}
	}
	for _, m := range mounts {
		if old, ok := p.mounts[m.Name]; ok && reflect.DeepEqual(old.spec, m) && !old.frozen {
			next[m.Name] = old
			continue
		}
		pm := &populated{spec: m, rejected: map[string]bool{}}
		for _, pr := range m.Projections {
			lim := limitsOf(m, pr)
			f, err := p.cache.Acquire(pr.Source, pr.Prefix, lim)
			if err != nil {
				undo()
				return fmt.Errorf("mount %q: %w", m.Name, err)
			}
			acquired = append(acquired, use{f, lim})
			pm.feeds = append(pm.feeds, f)
		}
		pm.snapshots = make([]*source.Snapshot, len(pm.feeds))
		pm.versions = make([]uint64, len(pm.feeds))
		next[m.Name] = pm
	}
	for name, old := range p.mounts {
		if next[name] != old {
			p.releaseFeeds(old)
		}
	}
	p.mounts = next
	p.dsw, p.users = nil, nil
	return nil
}

// SetSources replaces the source cache's sources (see
// source.Cache.SetSources).
func (p *Populator) SetSources(sources map[string]source.Source) {
	p.cache.SetSources(sources)
}

// SetObserver makes o receive the populator's events (SourceEvent,
// HeldBackEvent); the Reconciler sets it.
func (p *Populator) SetObserver(o Observer) { p.observer = o }

// WakeOnBuild makes f be called whenever a payload build that runs off the
// caller's loop ends (a mount with templates), so that the loop calls
// Populate again; the Reconciler sets its trigger.
func (p *Populator) WakeOnBuild(f func()) { p.wake = f }

// Close releases every feed, and waits for the builds in progress (each
// bounded by its templates' render timeout).
func (p *Populator) Close() {
	_ = p.SetMounts(nil)
	p.builds.Wait()
}

// Populate returns the desired state of world, rebuilding the payload of
// every mount whose feeds published a new snapshot since the last call.
// A mount whose feeds only changed health keeps its payload and generation.
// The map returned is the populator's own and is updated in place by the
// next call: read it before.
//
// It also tells the observer of each source whose health or newest
// revision changed (SourceEvent), as seen by the feeds in use.
//
// The first call after SetMounts visits every mount; the others only the
// mounts of the feeds that changed since the last call (FeedCache.TakeChanged), those whose
// payload builds off the loop, and those Rebuild named. At 1,000 mounts a
// visit of every one on each update took 80–120 µs of the worker's CPU,
// where one mount's takes 3 µs (BenchmarkPopulateOneChange).
func (p *Populator) Populate() DesiredState {
	if p.takeChanged == nil {
		p.takeChanged = func(f Feed) { p.changedFeeds = append(p.changedFeeds, f) }
	}
	clear(p.changedFeeds)
	p.changedFeeds = p.changedFeeds[:0]
	p.cache.TakeChanged(p.takeChanged)
	changedFeeds := p.changedFeeds
	p.changed, p.rebuilt = p.changed[:0], p.dsw == nil
	if p.dsw == nil {
		return p.populateAll()
	}
	for _, f := range changedFeeds {
		if u := p.users[f]; u != nil { // else released since it changed
			for _, pm := range u.mounts {
				p.due[pm] = struct{}{}
			}
		}
	}
	for pm := range p.due {
		if p.populate(pm) {
			p.dsw[pm.spec.Name] = pm.desired
			p.changed = append(p.changed, pm.spec.Name)
		}
		if !pm.building {
			delete(p.due, pm)
		}
	}
	if p.users == nil {
		// A mount froze: its feeds were released.
		p.index()
		p.reportSources()
	} else if len(changedFeeds) > 0 {
		p.reportSourcesOf(changedFeeds)
	}
	return p.dsw
}

// Changed implements ChangeReporter: the mounts the last Populate put
// anew into the desired state, or false when it built the desired state
// anew.
func (p *Populator) Changed(f func(name string)) bool {
	if p.rebuilt {
		return false
	}
	for _, name := range p.changed {
		f(name)
	}
	return true
}

// populateAll is Populate over every mount, after SetMounts: it indexes
// the mounts by feed (Populator.users) and reports every source's state
// anew. (A Populate in which a mount froze indexes the feeds anew itself.)
func (p *Populator) populateAll() DesiredState {
	fresh := p.dsw == nil
	if fresh {
		p.dsw = make(DesiredState, len(p.mounts))
	}
	clear(p.due)
	changed := fresh
	for name, pm := range p.mounts {
		if p.populate(pm) || fresh {
			p.dsw[name] = pm.desired
			changed = true
		}
		if pm.building {
			p.due[pm] = struct{}{}
		}
	}
	p.index()
	if changed {
		p.reportSources()
	}
	return p.dsw
}

// populate brings pm's desired mount up to date with its feeds and reports
// whether any feed changed since the last call (pm.desired is then new).
func (p *Populator) populate(pm *populated) bool {
	if pm.frozen {
		return false
	}
	took := p.takeBuilt(pm)
	if pm.frozen {
		return took
	}
	// Most mounts have one feed, and most passes change few mounts: the
	// states of a mount's first feeds live on the stack.
	var inline [4]source.FeedState
	states := inline[:0]
	if len(pm.feeds) > len(inline) {
		states = make([]source.FeedState, 0, len(pm.feeds))
	}
	states = states[:len(pm.feeds)]
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
		return took
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
			Missing: st.Snapshot.Missing, Entries: st.Snapshot.Entries, Oversized: st.Snapshot.Oversized,
			Secrets: st.Snapshot.Secrets,
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
		d.Payload, d.Released, d.Err, d.Generation, d.Revision, d.ChangedAt = pm.desired.Payload, pm.desired.Released, pm.desired.Err, pm.desired.Generation, pm.desired.Revision, pm.desired.ChangedAt
	case len(m.Templates) > 0:
		// Rendering may take up to its timeout per template: off the
		// loop, so that it delays this mount alone.
		p.buildAsync(pm, projections, slices.Clone(pm.snapshots), d.Revision)
		if pm.desired == nil {
			d.Generation = 0 // nothing to project before the first build
		} else {
			// The last payload stays desired meanwhile; its health is now.
			d.Payload, d.Released, d.Err, d.Generation, d.Revision, d.ChangedAt = pm.desired.Payload, pm.desired.Released, pm.desired.Err, pm.desired.Generation, pm.desired.Revision, pm.desired.ChangedAt
		}
	default:
		p.generation++
		d.Generation = p.generation
		d.ChangedAt = time.Now()
		payload, rejected, err := projector.MakePayload(m.Name, projections, p.options(pm))
		p.setPayload(pm, d, payload, rejected, err)
	}
	p.reportState(pm, d)
	pm.desired = d
	if m.Immutable && d.Ready() {
		p.freeze(pm)
	}
	return true
}

// ReleasePayload drops the populator's reference to mount's payload,
// which the caller has taken for good: a worker that sent it to the
// monitor, which holds and writes it, and never reads it again. The
// desired mount stays ready (DesiredMount.Released) with the same
// generation, until its feeds publish anew. The payloads of 1,000 mounts
// of 100 keys held past their sending were 9–10 MiB of a worker's
// resident memory. A mount whose payload is not built is left as it is.
func (p *Populator) ReleasePayload(mount string) {
	if pm := p.mounts[mount]; pm != nil && pm.desired != nil && pm.desired.Payload != nil {
		pm.desired.Payload, pm.desired.Released = nil, true
	}
}

// Rebuild has mount's payload built anew from the snapshots held, as a
// new generation, at the next Populate: for a worker whose monitor keeps
// no payload once written and asks for one again to repair drift
// (privsep.Resend). A mount not configured, not built yet, or frozen
// (immutable and projected: its feeds are released) is left as it is.
func (p *Populator) Rebuild(mount string) {
	if pm := p.mounts[mount]; pm != nil && !pm.frozen && pm.desired != nil {
		pm.desired = nil
		p.due[pm] = struct{}{}
	}
}

// options returns the options of pm's payload build.
func (p *Populator) options(pm *populated) projector.Options {
	m := pm.spec
	uid, gid := MountOwner(m)
	return projector.Options{
		Mode: m.DefaultMode, UID: uid, GID: gid,
		MaxValueSize: m.MaxValueSize, MaxSize: m.MaxMountSize, MaxFiles: m.MaxFiles,
		Templates: m.Templates, KeysOnlyForTemplates: !m.KeysAsFiles, Renders: &pm.renders,
	}
}

// setPayload makes a build's result d's payload or error, and reports it.
func (p *Populator) setPayload(pm *populated, d *DesiredMount, payload projector.Payload, rejected []*projector.KeyError, err error) {
	if err != nil {
		d.Err = err
		p.reportTooLarge(pm.spec.Name, d, err)
	} else {
		d.Payload = payload
	}
	p.reportRejected(pm, rejected)
}

// freeze stops following an immutable mount's sources once its payload is
// built (the kubelet stops watching immutable ConfigMaps and Secrets).
func (p *Populator) freeze(pm *populated) {
	p.releaseFeeds(pm)
	p.users = nil // indexed anew without its feeds
	pm.feeds, pm.snapshots, pm.versions = nil, nil, nil
	pm.frozen, pm.stale = true, false
	pm.desired = &DesiredMount{Spec: pm.desired.Spec, Payload: pm.desired.Payload, Released: pm.desired.Released, Generation: pm.desired.Generation, Revision: pm.desired.Revision, ChangedAt: pm.desired.ChangedAt}
	p.log.Info("immutable mount has its payload; no longer following its sources", "mount", pm.spec.Name, "revision", pm.desired.Revision)
}

// releaseFeeds gives up pm's feeds.
func (p *Populator) releaseFeeds(pm *populated) {
	for i, f := range pm.feeds {
		p.cache.Release(f, limitsOf(pm.spec, pm.spec.Projections[i]))
	}
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
	errText := ""
	if d.Err != nil {
		errText = d.Err.Error()
	}
	if errText != pm.reported {
		if d.Err != nil {
			p.log.Error("cannot build mount payload; keeping last content", "mount", pm.spec.Name, "err", d.Err)
		}
		pm.reported = errText
	}
	stale := len(d.Stale) > 0
	if stale != pm.stale {
		if stale {
			p.log.Warn("mount stale: source unreachable, keeping last content", "mount", pm.spec.Name, "err", errorsText(d.Stale))
		} else {
			p.log.Info("mount current: sources reachable again", "mount", pm.spec.Name)
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

// MountOwner returns the owner of m's files: its configured uid and gid,
// or for one not configured (-1) the daemon's own effective id, read once
// when it started.
func MountOwner(m *config.Mount) (uid, gid int) {
	return ownerID(m.UID, processUID), ownerID(m.GID, processGID)
}

// ownerID returns id, or def when id is -1 (not configured).
func ownerID(id, def int) int {
	if id < 0 {
		return def
	}
	return id
}
