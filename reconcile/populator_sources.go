package reconcile

import (
	"slices"
	"strings"
	"time"
)

// What the populator reports of each source: its health and newest
// revision, from the feeds in use, and the index of those feeds.

// sourceState is what was last reported of a source.
type sourceState struct {
	err      string
	revision string
}

// feedUse is what the populator knows of a feed in use: its source and
// the mounts it feeds.
type feedUse struct {
	source string
	mounts []*populated
}

// index builds Populator.users and bySource from the mounts' feeds. A
// frozen mount has none.
func (p *Populator) index() {
	p.users, p.bySource = map[Feed]*feedUse{}, map[string][]Feed{}
	for _, pm := range p.mounts {
		for i, f := range pm.feeds {
			u := p.users[f]
			if u == nil {
				u = &feedUse{source: pm.spec.Projections[i].Source}
				p.users[f] = u
				p.bySource[u.source] = append(p.bySource[u.source], f)
			}
			u.mounts = append(u.mounts, pm)
		}
	}
}

// reportSources sends a SourceEvent for every source whose health or
// newest revision changed since the last call, from every feed in use
// (the index: bySource).
func (p *Populator) reportSources() {
	now := make(map[string]sourceState, len(p.bySource))
	for name, feeds := range p.bySource {
		cur, err := sourceStateOf(feeds)
		if prev, ok := p.sources[name]; !ok || prev != cur {
			p.observer.Observe(SourceEvent{Source: name, Err: err, Revision: cur.revision, Time: time.Now()})
		}
		now[name] = cur
	}
	p.sources = now
}

// sourceStateOf returns a source's state from all of its feeds: failing
// with the first failure among them, if any, and at the newest revision of
// their snapshots. The error is that failure's.
func sourceStateOf(feeds []Feed) (sourceState, error) {
	var cur sourceState
	var err error
	for _, f := range feeds {
		st := f.State()
		if st.Err != nil && err == nil {
			cur.err, err = st.Err.Error(), st.Err
		}
		if st.Snapshot != nil && newerRevision(st.Snapshot.Revision, cur.revision) {
			cur.revision = st.Snapshot.Revision
		}
	}
	return cur, err
}

// reportSourcesOf is reportSources after only the feeds changed changed
// state: a source none of them belongs to is as it was. A source stays
// reachable with its newest revision at least what it was while each
// changed feed has no error and a revision no older than the one last
// reported (or none yet); the source's state is then the newer of the
// two, found without reading its other feeds. Else — a feed failing or
// recovering, a revision gone back (a source replaced on reload, a
// Consul index reset) — every feed of that source is read, as
// reportSources does.
func (p *Populator) reportSourcesOf(changed []Feed) {
	var recount []string
	if p.sourcesOf == nil {
		p.sourcesOf = map[string]sourceState{}
	}
	next := p.sourcesOf
	defer clear(next)
	for _, f := range changed {
		u := p.users[f]
		if u == nil || slices.Contains(recount, u.source) {
			continue // released since it changed, or read below anyway
		}
		cur, seen := next[u.source]
		if !seen {
			cur = p.sources[u.source]
		}
		st := f.State()
		switch {
		case st.Err != nil || cur.err != "":
			recount = append(recount, u.source)
			delete(next, u.source)
			continue
		case st.Snapshot == nil || st.Snapshot.Revision == cur.revision:
		case newerRevision(st.Snapshot.Revision, cur.revision):
			cur.revision = st.Snapshot.Revision
		default:
			recount = append(recount, u.source)
			delete(next, u.source)
			continue
		}
		next[u.source] = cur
	}
	var errs map[string]error
	for _, name := range recount {
		cur, err := sourceStateOf(p.bySource[name])
		if err != nil {
			if errs == nil {
				errs = map[string]error{}
			}
			errs[name] = err
		}
		next[name] = cur
	}
	for name, cur := range next {
		if prev, ok := p.sources[name]; !ok || prev != cur {
			p.observer.Observe(SourceEvent{Source: name, Err: errs[name], Revision: cur.revision, Time: time.Now()})
		}
		p.sources[name] = cur
	}
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
