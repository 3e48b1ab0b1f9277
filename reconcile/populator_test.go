package reconcile

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/source"
)

// fakeFeed is a feed whose state the test sets.
type fakeFeed struct {
	cache *fakeCache
	mu    sync.Mutex
	state source.FeedState
}

func (f *fakeFeed) State() source.FeedState {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.state
}

// publish sets a new snapshot of entries (nil: a missing prefix).
func (f *fakeFeed) publish(rev string, entries map[string]string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := map[string][]byte{}
	for k, v := range entries {
		m[k] = []byte(v)
	}
	s := &source.Snapshot{Revision: rev, Missing: len(entries) == 0, Entries: kvset.FromMap(m)}
	f.state = source.FeedState{Snapshot: s, Version: f.state.Version + 1}
	f.cache.markChanged(f)
}

// fail sets the source's health.
func (f *fakeFeed) fail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.state.Err = err
	f.state.Version++
	f.cache.markChanged(f)
}

// fakeCache hands out one fakeFeed per (source, prefix) and counts uses.
type fakeCache struct {
	mu    sync.Mutex
	feeds map[string]*fakeFeed
	refs  map[string]int
	log   []string // "acquire s p" / "release s p"
	// changed are the feeds published or failed since TakeChanged.
	changed map[*fakeFeed]bool
}

func (c *fakeCache) markChanged(f *fakeFeed) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.changed == nil {
		c.changed = map[*fakeFeed]bool{}
	}
	c.changed[f] = true
}

func (c *fakeCache) TakeChanged(fn func(Feed)) {
	c.mu.Lock()
	taken := c.changed
	c.changed = nil
	c.mu.Unlock()
	for f := range taken {
		fn(f)
	}
}

func newFakeCache() *fakeCache {
	return &fakeCache{feeds: map[string]*fakeFeed{}, refs: map[string]int{}}
}

func (c *fakeCache) feed(src, prefix string) *fakeFeed {
	c.mu.Lock()
	defer c.mu.Unlock()
	key := src + " " + prefix
	if c.feeds[key] == nil {
		c.feeds[key] = &fakeFeed{cache: c}
	}
	return c.feeds[key]
}

func (c *fakeCache) Acquire(src, prefix string, _ source.Limits) (Feed, error) {
	if src == "unknown" {
		return nil, errors.New("source: unknown source \"unknown\"")
	}
	f := c.feed(src, prefix)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.refs[src+" "+prefix]++
	c.log = append(c.log, "acquire "+src+" "+prefix)
	return f, nil
}

func (c *fakeCache) Release(f Feed, _ source.Limits) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for key, ff := range c.feeds {
		if ff == f {
			c.refs[key]--
			c.log = append(c.log, "release "+key)
		}
	}
}

func (c *fakeCache) SetSources(map[string]source.Source) {}

// takeLog returns and clears the acquire/release log.
func (c *fakeCache) takeLog() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := strings.Join(c.log, "; ")
	c.log = nil
	return out
}

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

func testMount(name, prefix string, opts ...func(*config.Mount)) *config.Mount {
	m := &config.Mount{Name: name, Dir: "/srv/" + name, Medium: config.MediumDisk, DefaultMode: 0o644, DirMode: 0o755, UID: -1, GID: -1,
		Projections: []config.Projection{{Source: "main", Prefix: prefix}}}
	for _, o := range opts {
		o(m)
	}
	return m
}

// describe renders a desired mount for comparison.
func describeDesired(d *DesiredMount) string {
	var files []string
	for _, p := range d.Payload.Paths() {
		files = append(files, p+"="+string(d.Payload[p].Data))
	}
	s := fmt.Sprintf("gen=%d ready=%v files=%v", d.Generation, d.Ready(), files)
	if len(d.Waiting) > 0 {
		s += fmt.Sprintf(" waiting=%v", d.Waiting)
	}
	if len(d.Stale) > 0 {
		s += " stale"
	}
	if d.Err != nil {
		s += " err=" + d.Err.Error()
	}
	return s
}

// TestPopulator walks one mount through the populator's rules, step by
// step: what the desired state is after each change of its feed.
func TestPopulator(t *testing.T) {
	cache := newFakeCache()
	p := NewPopulatorFor(cache, discard)
	if err := p.SetMounts([]*config.Mount{testMount("app", "/app/")}); err != nil {
		t.Fatal(err)
	}
	feed := cache.feed("main", "/app/")
	steps := []struct {
		name   string
		change func()
		want   string
	}{
		{"waiting for the first snapshot", func() {}, "gen=0 ready=false files=[] waiting=[main]"},
		{"first snapshot", func() { feed.publish("1", map[string]string{"a": "1"}) }, "gen=1 ready=true files=[a=1]"},
		{"nothing changed", func() {}, "gen=1 ready=true files=[a=1]"},
		{"source down: same payload and generation, stale", func() { feed.fail(errors.New("unreachable")) }, "gen=1 ready=true files=[a=1] stale"},
		{"source back", func() { feed.fail(nil) }, "gen=1 ready=true files=[a=1]"},
		{"new snapshot: new generation", func() { feed.publish("2", map[string]string{"a": "2", "b/c": "3"}) }, "gen=2 ready=true files=[a=2 b/c=3]"},
		{"prefix gone: an error, no payload", func() { feed.publish("3", nil) }, `gen=3 ready=false files=[] err=mount "app": source "main": prefix "/app/" does not exist`},
		{"a rejected key is skipped", func() { feed.publish("4", map[string]string{"ok": "1", "../x": "2"}) }, "gen=4 ready=true files=[ok=1]"},
	}
	for _, s := range steps {
		s.change()
		if got := describeDesired(p.Populate()["app"]); got != s.want {
			t.Errorf("%s: %s; want %s", s.name, got, s.want)
		}
	}
}

// TestReleasePayload: a released payload leaves its mount ready at the
// same generation, through a change of health; the next snapshot builds a
// payload again, under a new generation.
func TestReleasePayload(t *testing.T) {
	cache := newFakeCache()
	p := NewPopulatorFor(cache, discard)
	if err := p.SetMounts([]*config.Mount{testMount("app", "/app/")}); err != nil {
		t.Fatal(err)
	}
	feed := cache.feed("main", "/app/")
	p.ReleasePayload("app") // nothing built yet: nothing to release
	if d := p.Populate()["app"]; d.Ready() || d.Released {
		t.Fatalf("before a snapshot: ready %v, released %v", d.Ready(), d.Released)
	}
	feed.publish("1", map[string]string{"a": "1"})
	p.Populate()
	p.ReleasePayload("app")
	p.ReleasePayload("nobody")
	check := func(step string, released bool, gen uint64, files string, stale bool) {
		t.Helper()
		d := p.Populate()["app"]
		if !d.Ready() || d.Released != released || d.Generation != gen || (len(d.Stale) > 0) != stale {
			t.Errorf("%s: ready %v released %v generation %d stale %v; want released %v, generation %d, stale %v", step, d.Ready(), d.Released, d.Generation, d.Stale, released, gen, stale)
		}
		if got := describeDesired(d); !strings.Contains(got, "files=["+files+"]") {
			t.Errorf("%s: %s; want files=[%s]", step, got, files)
		}
	}
	check("released", true, 1, "", false)
	feed.fail(errors.New("unreachable"))
	check("released, then the source down", true, 1, "", true)
	feed.publish("2", map[string]string{"a": "2"})
	check("a new snapshot (the source back)", false, 2, "a=2", false)
}

// TestPopulatorSetMounts: unchanged mounts keep their feeds, changed ones
// are rebuilt, removed ones release theirs, an unknown source changes
// nothing, and an immutable mount releases its feed once built and
// acquires it again on reload.
func TestPopulatorSetMounts(t *testing.T) {
	cache := newFakeCache()
	p := NewPopulatorFor(cache, discard)
	set := func(mounts ...*config.Mount) error { return p.SetMounts(mounts) }
	if err := set(testMount("a", "/a/"), testMount("b", "/b/")); err != nil {
		t.Fatal(err)
	}
	if got := cache.takeLog(); got != "acquire main /a/; acquire main /b/" {
		t.Errorf("first SetMounts: %s", got)
	}
	if err := set(testMount("a", "/a/"), testMount("b", "/b2/")); err != nil {
		t.Fatal(err)
	}
	if got := cache.takeLog(); got != "acquire main /b2/; release main /b/" {
		t.Errorf("b changed: %s; want its new feed acquired and the old released, a untouched", got)
	}
	bad := testMount("c", "/c/")
	bad.Projections[0].Source = "unknown"
	if err := set(testMount("a", "/a/"), bad); err == nil {
		t.Errorf("SetMounts with an unknown source = nil; want an error")
	}
	if got := cache.takeLog(); got != "" {
		t.Errorf("a failed SetMounts changed feeds: %s", got)
	}
	imm := func(m *config.Mount) { m.Immutable = true }
	if err := set(testMount("a", "/a/"), testMount("i", "/i/", imm)); err != nil {
		t.Fatal(err)
	}
	cache.takeLog()
	cache.feed("main", "/i/").publish("1", map[string]string{"k": "1"})
	if got := describeDesired(p.Populate()["i"]); got != "gen=1 ready=true files=[k=1]" {
		t.Errorf("immutable: %s", got)
	}
	if got := cache.takeLog(); got != "release main /i/" {
		t.Errorf("immutable mount built: %s; want its feed released", got)
	}
	cache.feed("main", "/i/").publish("2", map[string]string{"k": "2"})
	if got := describeDesired(p.Populate()["i"]); got != "gen=1 ready=true files=[k=1]" {
		t.Errorf("immutable after a change: %s; want it frozen", got)
	}
	if err := set(testMount("a", "/a/"), testMount("i", "/i/", imm)); err != nil {
		t.Fatal(err)
	}
	if got := cache.takeLog(); got != "acquire main /i/" {
		t.Errorf("reload of an immutable mount: %s; want its feed acquired again", got)
	}
	if got := describeDesired(p.Populate()["i"]); !strings.Contains(got, "files=[k=2]") {
		t.Errorf("immutable after reload: %s; want k=2", got)
	}
	p.Close()
	for key, n := range cache.refs {
		if n != 0 {
			t.Errorf("%s still has %d uses after Close", key, n)
		}
	}
	if log := strings.Split(cache.takeLog(), "; "); !slices.Contains(log, "release main /a/") {
		t.Errorf("Close released %v", log)
	}
}

// recordObserver keeps the events it is told of.
type recordObserver struct{ events []Event }

func (r *recordObserver) Observe(ev Event) { r.events = append(r.events, ev) }

// TestPopulatorReportsSizeLimits: a payload over max_value_size or
// max_mount_size is a HeldBackEvent naming the limit, once per payload
// built; other payload errors are not.
func TestPopulatorReportsSizeLimits(t *testing.T) {
	cache := newFakeCache()
	p := NewPopulatorFor(cache, discard)
	rec := &recordObserver{}
	p.observer = rec
	if err := p.SetMounts([]*config.Mount{
		testMount("value", "/v/", func(m *config.Mount) { m.MaxValueSize = 4 }),
		testMount("mount", "/m/", func(m *config.Mount) { m.MaxMountSize = 4 }),
	}); err != nil {
		t.Fatal(err)
	}
	cache.feed("main", "/v/").publish("1", map[string]string{"a": "12345"})
	cache.feed("main", "/m/").publish("1", map[string]string{"a": "123", "b": "45"})
	p.Populate()
	p.Populate()                                // nothing new: no second event
	cache.feed("main", "/v/").publish("2", nil) // a missing prefix is no size limit
	p.Populate()
	var got []string
	for _, ev := range rec.events {
		if hb, ok := ev.(HeldBackEvent); ok {
			got = append(got, hb.Mount+" "+hb.Guard)
			if !strings.Contains(hb.Reason, "exceeds "+hb.Guard) {
				t.Errorf("reason %q does not name %s", hb.Reason, hb.Guard)
			}
		}
	}
	slices.Sort(got)
	if want := []string{"mount max_mount_size", "value max_value_size"}; !slices.Equal(got, want) {
		t.Errorf("held back: %q; want %q", got, want)
	}
}

// TestPopulateVisitsOnlyWhatChanged checks Populate after its first call,
// which visits the mounts of the feeds that changed and reports their
// sources from those feeds alone (reportSourcesOf): through 2,000 random
// steps over 12 mounts on 8 feeds of 3 sources — new snapshots with
// revisions that mostly grow and sometimes go back, failures and
// recoveries, a mount rebuilt — every mount's desired payload and every
// source's reported health and newest revision after each call are what
// they would be if every feed were read: the first call's way, which is
// what they were before the populator tracked changes.
func TestPopulateVisitsOnlyWhatChanged(t *testing.T) {
	cache := newFakeCache()
	p := NewPopulatorFor(cache, discard)
	type feedOf struct{ src, prefix string }
	var feeds []feedOf
	for i := range 8 {
		feeds = append(feeds, feedOf{[]string{"a", "b", "c"}[i%3], fmt.Sprintf("/f%d/", i)})
	}
	var mounts []*config.Mount
	for i := range 12 {
		f := feeds[i%len(feeds)]
		m := testMount(fmt.Sprintf("m%02d", i), f.prefix)
		m.Projections[0].Source = f.src
		if i >= 8 { // a second projection: a mount of two feeds
			g := feeds[(i+3)%len(feeds)]
			m.Projections = append(m.Projections, config.Projection{Source: g.src, Prefix: g.prefix})
		}
		mounts = append(mounts, m)
	}
	if err := p.SetMounts(mounts); err != nil {
		t.Fatal(err)
	}
	reported := map[string]SourceEvent{}
	p.SetObserver(ObserverFunc(func(ev Event) {
		if se, ok := ev.(SourceEvent); ok {
			reported[se.Source] = se
		}
	}))
	rng := rand.New(rand.NewPCG(1, 2))
	revs := make([]int, len(feeds))
	for i, f := range feeds {
		revs[i] = 10
		cache.feed(f.src, f.prefix).publish("10", map[string]string{fmt.Sprintf("k%d", i): "v10"})
	}
	dsw := p.Populate()
	if p.Changed(func(string) {}) {
		t.Fatal("Changed after the first Populate says some mounts changed; want the desired state built anew")
	}
	for step := range 2000 {
		rebuilt := map[string]uint64{} // mount: generation before Rebuild
		for range 1 + rng.IntN(3) {
			i := rng.IntN(len(feeds))
			ff := cache.feed(feeds[i].src, feeds[i].prefix)
			switch r := rng.IntN(10); {
			case r < 6:
				revs[i] += 1 + rng.IntN(3)
			case r < 7:
				revs[i] -= 1 + rng.IntN(5) // gone back
			case r < 8:
				ff.fail(errors.New("unreachable"))
				continue
			case r < 9:
				ff.fail(nil)
				continue
			default:
				m := mounts[rng.IntN(len(mounts))].Name
				if _, ok := rebuilt[m]; !ok {
					rebuilt[m] = dsw[m].Generation
				}
				p.Rebuild(m)
				continue
			}
			rev := strconv.Itoa(revs[i])
			ff.publish(rev, map[string]string{fmt.Sprintf("k%d", i): "v" + rev})
		}
		before := maps.Clone(dsw)
		dsw = p.Populate()
		// Changed names the mounts put anew into the desired state, and
		// only those.
		changed := map[string]bool{}
		if !p.Changed(func(name string) { changed[name] = true }) {
			t.Fatalf("step %d: Changed says the desired state was built anew", step)
		}
		for _, m := range mounts {
			if moved := dsw[m.Name] != before[m.Name]; moved != changed[m.Name] {
				t.Fatalf("step %d: %s's desired mount replaced: %v; Changed names it: %v", step, m.Name, moved, changed[m.Name])
			}
		}
		for m, gen := range rebuilt {
			if dsw[m].Generation <= gen {
				t.Fatalf("step %d: %s rebuilt, and still at generation %d", step, m, gen)
			}
		}
		for i, m := range mounts {
			var want []string
			for _, pr := range m.Projections {
				st := cache.feed(pr.Source, pr.Prefix).State()
				want = append(want, pr.Source+"@"+st.Snapshot.Revision)
			}
			first := i % len(feeds)
			file := fmt.Sprintf("k%d", first)
			data := "v" + cache.feed(feeds[first].src, feeds[first].prefix).State().Snapshot.Revision
			if d := dsw[m.Name]; d == nil || d.Revision != strings.Join(want, ",") || string(d.Payload[file].Data) != data {
				t.Fatalf("step %d: %s desired %s at %q, want revision %v and %s=%s", step, m.Name, describeDesired(d), d.Revision, want, file, data)
			}
		}
		for _, src := range []string{"a", "b", "c"} {
			failing, newest := false, ""
			for _, f := range feeds {
				if f.src != src {
					continue
				}
				st := cache.feed(f.src, f.prefix).State()
				failing = failing || st.Err != nil
				if newerRevision(st.Snapshot.Revision, newest) {
					newest = st.Snapshot.Revision
				}
			}
			got := reported[src]
			if (got.Err != nil) != failing || got.Revision != newest {
				t.Fatalf("step %d: source %s reported err=%v revision=%q; its feeds: failing=%v newest=%q", step, src, got.Err, got.Revision, failing, newest)
			}
		}
	}
}
