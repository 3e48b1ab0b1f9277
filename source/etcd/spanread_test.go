package etcd

import (
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/source"
)

// TestSpans: runs of at most per members, except that a member inside a
// run's range stays in it (nested prefixes, the same prefix twice, the
// empty prefix, which holds every key).
func TestSpans(t *testing.T) {
	members := func(prefixes ...string) []*member {
		var ms []*member
		for _, p := range prefixes {
			ms = append(ms, &member{prefix: p})
		}
		return ms
	}
	prefixes := func(runs [][]*member) [][]string {
		var out [][]string
		for _, run := range runs {
			var ps []string
			for _, m := range run {
				ps = append(ps, m.prefix)
			}
			out = append(out, ps)
		}
		return out
	}
	for _, tc := range []struct {
		in   []string
		per  int
		want [][]string
	}{
		{[]string{"/a/", "/b/", "/c/", "/d/", "/e/"}, 2, [][]string{{"/a/", "/b/"}, {"/c/", "/d/"}, {"/e/"}}},
		{[]string{"/a/", "/b/", "/c/"}, 0, [][]string{{"/a/"}, {"/b/"}, {"/c/"}}},
		{[]string{"/a/", "/a/b/", "/a/c/", "/a/d/", "/b/", "/c/"}, 2, [][]string{{"/a/", "/a/b/", "/a/c/", "/a/d/"}, {"/b/", "/c/"}}},
		{[]string{"/a/", "/b/", "/b/", "/b/x/", "/c/"}, 2, [][]string{{"/a/", "/b/", "/b/", "/b/x/"}, {"/c/"}}},
		{[]string{"", "/a/", "/b/"}, 1, [][]string{{"", "/a/", "/b/"}}},
		{[]string{"/a", "/a/", "/ab/", "/b/"}, 1, [][]string{{"/a", "/a/", "/ab/"}, {"/b/"}}},
	} {
		if got := prefixes(spans(members(tc.in...), tc.per)); !slices.EqualFunc(got, tc.want, slices.Equal) {
			t.Errorf("spans(%q, %d) = %q; want %q", tc.in, tc.per, got, tc.want)
		}
	}
}

// TestSpanReads: 200 prefixes of one source are read in spans, a few
// range requests instead of 200 (issue 37), and each prefix's first
// snapshot is what a read of its own returns: a prefix inside another, one
// followed twice, one without keys, one whose value its mount does not
// keep, keys beside the prefixes that no mount takes; a prefix over its
// mount's limits is reported and the others are not held with it.
func TestSpanReads(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	const n = 200
	var kv []string
	for i := range n {
		switch i {
		case 30: // no key
		case 40:
			kv = append(kv, "/sp/m040/big", "a value of 25 bytes, kept")
		case 50:
			kv = append(kv, "/sp/m050/a", "1", "/sp/m050/b", "2", "/sp/m050/c", "3")
		default:
			kv = append(kv, fmt.Sprintf("/sp/m%03d/k", i), fmt.Sprint(i))
		}
	}
	kv = append(kv, "/sp/m010/in/x", "inner", "/sp/m005", "stray", "/sp/m005x/y", "stray", "/sp/m0055", "stray")
	for i := 0; i < len(kv); i += 128 {
		etcdtest.Put(t, cli, kv[i:min(i+128, len(kv))]...)
	}
	var pages atomic.Int64
	testHookPageRead = func(int) { pages.Add(1) }
	t.Cleanup(func() { testHookPageRead = nil })

	src := newSource(t, srv)
	recs := map[string]*sourcetest.Recorder{}
	for i := range n {
		prefix := fmt.Sprintf("/sp/m%03d/", i)
		switch i {
		case 40:
			recs[prefix] = sourcetest.FollowLimited(t, src, prefix, source.Limits{MaxValueSize: 10})
		case 50:
			recs[prefix] = sourcetest.FollowLimited(t, src, prefix, source.Limits{MaxKeys: 2})
		default:
			recs[prefix] = sourcetest.Follow(t, src, prefix)
		}
	}
	inner := sourcetest.Follow(t, src, "/sp/m010/in/")
	twice := sourcetest.Follow(t, src, "/sp/m020/")
	for i := range n {
		prefix := fmt.Sprintf("/sp/m%03d/", i)
		rec := recs[prefix]
		switch i {
		case 10:
			rec.WaitFor(t, prefix, sourcetest.Holds(map[string]string{"k": "10", "in/x": "inner"}))
		case 30:
			rec.WaitFor(t, prefix+", empty", sourcetest.Missing)
		case 40:
			rec.WaitFor(t, prefix+", its value not kept", func(snaps []source.Snapshot, _ error) bool {
				s := sourcetest.Last(snaps)
				return s != nil && s.Entries.Len() == 0 && s.Oversized["big"] == 25
			})
		case 50:
			rec.WaitFor(t, prefix+", over its limits", sourcetest.Failing)
			if snaps, _ := rec.State(); len(snaps) != 0 {
				t.Errorf("%s published %d snapshots over its limits", prefix, len(snaps))
			}
		default:
			rec.WaitFor(t, prefix, sourcetest.Holds(map[string]string{"k": fmt.Sprint(i)}))
		}
	}
	inner.WaitFor(t, "the prefix inside another", sourcetest.Holds(map[string]string{"x": "inner"}))
	twice.WaitFor(t, "the prefix followed twice", sourcetest.Holds(map[string]string{"k": "20"}))
	// Two groups (/sp/m0, /sp/m1), each its first prefix on its own and
	// the others in 15 spans of 7 at most: 32 requests, the held prefix
	// read again on its own after its backoff; not 200.
	if got := pages.Load(); got > 40 {
		t.Errorf("%d range requests for %d prefixes; want about 32", got, n+2)
	}
	// A key of no mount's, after the reads: published to none.
	etcdtest.Put(t, cli, "/sp/m005z", "stray", "/sp/m006/k", "6'")
	recs["/sp/m006/"].WaitFor(t, "m006's write", sourcetest.Holds(map[string]string{"k": "6'"}))
	if snaps, _ := recs["/sp/m005/"].State(); len(snaps) != 1 {
		t.Errorf("m005 published %d snapshots; want 1", len(snaps))
	}
}

// TestSpanGivesUpOnKeysOfNoMount: a span that has read more keys of no
// mount than nonMemberKeys, with more to read, stops, and its prefixes not
// read yet are read on their own; each gets its keys all the same.
func TestSpanGivesUpOnKeysOfNoMount(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	const n = 200
	var kv []string
	for i := range n {
		kv = append(kv, fmt.Sprintf("/gu/m%03d/k", i), fmt.Sprint(i))
	}
	for i := range 2 * nonMemberKeys {
		kv = append(kv, fmt.Sprintf("/gu/m005x/%05d", i), "stray")
	}
	for i := 0; i < len(kv); i += 128 {
		etcdtest.Put(t, cli, kv[i:min(i+128, len(kv))]...)
	}
	var log testlog.Buffer
	src, err := New("main", &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch, DialTimeout: 2 * time.Second},
		slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	recs := make([]*sourcetest.Recorder, n)
	for i := range n {
		recs[i] = sourcetest.Follow(t, src, fmt.Sprintf("/gu/m%03d/", i))
	}
	for i, rec := range recs {
		rec.WaitFor(t, fmt.Sprintf("m%03d", i), sourcetest.Holds(map[string]string{"k": fmt.Sprint(i)}))
	}
	if log.Count("reading a span's prefixes one by one", "of no mount's prefix") != 1 {
		t.Errorf("the span with the keys of no mount did not give up once:\n%s", log.String())
	}
}

// TestSpanPagesAtOneRevision writes every key while the spans are being
// read in pages: each prefix's first snapshot holds the values of one
// revision only (the read is pinned), and the write arrives through the
// watch.
func TestSpanPagesAtOneRevision(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	// Nine branches after /rv/: one group of 36, in spans of three
	// prefixes of 400 keys, each two pages.
	var prefixes []string
	for c := 'a'; c <= 'i'; c++ {
		for d := range 4 {
			prefixes = append(prefixes, fmt.Sprintf("/rv/%c%d/", c, d))
		}
	}
	const keys = 400
	put := func(v string) {
		var kv []string
		for _, p := range prefixes {
			for k := range keys {
				kv = append(kv, fmt.Sprintf("%sk%03d", p, k), v)
			}
		}
		for i := 0; i < len(kv); i += 2 * 100 {
			etcdtest.Put(t, cli, kv[i:min(i+200, len(kv))]...)
		}
	}
	put("old")
	var once sync.Once
	var pagesAfter atomic.Int64
	testHookAfterPage = func() {
		pagesAfter.Add(1)
		once.Do(func() { put("new") })
	}
	t.Cleanup(func() { testHookAfterPage = nil })
	src := newSource(t, srv)
	recs := make([]*sourcetest.Recorder, len(prefixes))
	for i, p := range prefixes {
		recs[i] = sourcetest.Follow(t, src, p)
	}
	want := map[string]string{}
	for k := range keys {
		want[fmt.Sprintf("k%03d", k)] = "new"
	}
	for i, rec := range recs {
		rec.WaitFor(t, prefixes[i]+", the writes made during the read", sourcetest.Holds(want))
		snaps, _ := rec.State()
		values := map[string]int{}
		for _, v := range snaps[0].Entries.All() {
			values[string(v)]++
		}
		if snaps[0].Entries.Len() != keys || values["old"] != keys {
			t.Errorf("%s's first snapshot: %d keys, values %v; want %d keys all \"old\" (one revision)", prefixes[i], snaps[0].Entries.Len(), values, keys)
		}
	}
	if pagesAfter.Load() < 2 {
		t.Errorf("%d pages were followed by another; want the spans read in several pages", pagesAfter.Load())
	}
}
