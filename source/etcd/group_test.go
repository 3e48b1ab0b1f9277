package etcd

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/internal/embedetcd"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/source"
)

// watchers returns the watchers the member srv holds, from its metrics
// (etcd_debugging_mvcc_watcher_total).
func watchers(t *testing.T, srv *embedetcd.Server) int {
	t.Helper()
	resp, err := http.Get(srv.Endpoint() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^etcd_debugging_mvcc_watcher_total ([0-9.e+]+)$`).FindSubmatch(body)
	if m == nil {
		t.Fatalf("no etcd_debugging_mvcc_watcher_total in the member's metrics")
	}
	n, _ := strconv.ParseFloat(string(m[1]), 64)
	return int(n)
}

// newSource returns a Source of srv in watch mode, closed when the test
// ends (after the follows).
func newSource(t *testing.T, srv *embedetcd.Server) *Source {
	t.Helper()
	src, err := New("main", &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch, DialTimeout: 2 * time.Second}, sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	return src
}

// waitWatchers waits until the member holds want watchers.
func waitWatchers(t *testing.T, srv *embedetcd.Server, want int) {
	t.Helper()
	for deadline := time.Now().Add(sourcetest.Timeout); ; time.Sleep(20 * time.Millisecond) {
		n := watchers(t, srv)
		if n == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the member holds %d watchers; want %d", n, want)
		}
	}
}

// putPrefixKeys writes the key "k" = "v0" under each of n prefixes,
// format with 0 to n-1, 64 prefixes to a transaction.
func putPrefixKeys(t *testing.T, cli *clientv3.Client, format string, n int) {
	t.Helper()
	var kv []string
	for i := range n {
		kv = append(kv, fmt.Sprintf(format, i)+"k", "v0")
	}
	for i := 0; i < len(kv); i += 128 {
		etcdtest.Put(t, cli, kv[i:min(i+128, len(kv))]...)
	}
}

// TestOneWatchForManyPrefixes is issue 37's second finding: 200 prefixes
// of one source are two watches on the member, not 200; each prefix gets
// its own keys, a transaction across prefixes switches each at once, and
// a write under the group's prefix but outside every followed one
// publishes nothing.
func TestOneWatchForManyPrefixes(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	before := watchers(t, srv)
	const n = 200
	putPrefixKeys(t, cli, "/fleet/m%03d/", n)
	src := newSource(t, srv)
	recs := make([]*sourcetest.Recorder, n)
	for i := range n {
		recs[i] = sourcetest.Follow(t, src, fmt.Sprintf("/fleet/m%03d/", i))
	}
	var prefixes []string
	for i, rec := range recs {
		rec.WaitFor(t, fmt.Sprintf("m%03d's first snapshot", i), sourcetest.Holds(map[string]string{"k": "v0"}))
		prefixes = append(prefixes, fmt.Sprintf("/fleet/m%03d/", i))
	}
	// Two: /fleet/m0 and /fleet/m1 (source.Partition).
	if groups := source.Partition(prefixes, maxWatches); len(groups) != 2 {
		t.Fatalf("groups %q", groups)
	}
	waitWatchers(t, srv, before+2)

	// One transaction, two prefixes: each switches once, with both of
	// its keys.
	etcdtest.Put(t, cli, "/fleet/m007/k", "v1", "/fleet/m007/j", "v1", "/fleet/m150/k", "v1", "/fleet/m150/j", "v1")
	for _, i := range []int{7, 150} {
		recs[i].WaitFor(t, fmt.Sprintf("m%03d's transaction", i), sourcetest.Holds(map[string]string{"k": "v1", "j": "v1"}))
		if snaps, _ := recs[i].State(); len(snaps) != 2 {
			t.Errorf("m%03d published %d snapshots; want 2 (the transaction in one)", i, len(snaps))
		}
	}
	// Keys beside the prefixes, inside the group's: nothing published.
	etcdtest.Put(t, cli, "/fleet/m9/x", "other", "/fleet/m000", "other")
	etcdtest.Put(t, cli, "/fleet/m008/k", "v2")
	recs[8].WaitFor(t, "m008's write", sourcetest.Holds(map[string]string{"k": "v2"}))
	for i, rec := range recs {
		if want := map[int]int{7: 2, 150: 2, 8: 2}[i]; want == 0 {
			if snaps, _ := rec.State(); len(snaps) != 1 {
				t.Errorf("m%03d published %d snapshots; want 1", i, len(snaps))
			}
		}
	}
}

// TestNestedPrefixesShareEvents: a key under two followed prefixes, one
// inside the other, reaches both.
func TestNestedPrefixesShareEvents(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	src := newSource(t, srv)
	outer := sourcetest.Follow(t, src, "/n/")
	inner := sourcetest.Follow(t, src, "/n/a/")
	outer.WaitFor(t, "outer, empty", sourcetest.Missing)
	inner.WaitFor(t, "inner, empty", sourcetest.Missing)
	etcdtest.Put(t, cli, "/n/a/x", "1", "/n/b", "2")
	outer.WaitFor(t, "outer", sourcetest.Holds(map[string]string{"a/x": "1", "b": "2"}))
	inner.WaitFor(t, "inner", sourcetest.Holds(map[string]string{"x": "1"}))
}

// TestJoinAndLeaveARunningGroup: a prefix that joins a running watch is
// read on its own and follows the group's events from that read on, while
// its keys are being written (it never goes back); one that leaves stops
// being published, and the watch ends with the last.
func TestJoinAndLeaveARunningGroup(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	before := watchers(t, srv)
	src := newSource(t, srv)
	// Twenty branches at the first difference: one group, /g/.
	var first []*sourcetest.Recorder
	var stops []func(error)
	for i := range 20 {
		rec, stop := sourcetest.FollowStoppable(t, src, fmt.Sprintf("/g/%c/", 'a'+i), source.Limits{})
		first = append(first, rec)
		stops = append(stops, stop)
	}
	for _, rec := range first {
		rec.WaitFor(t, "empty", sourcetest.Missing)
	}
	waitWatchers(t, srv, before+1)

	// A writer counts up under /g/z/ while it joins.
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	var last int
	wg.Go(func() {
		for i := 1; ctx.Err() == nil && i <= 300; i++ {
			if _, err := cli.Put(ctx, "/g/z/n", strconv.Itoa(i)); err == nil {
				last = i
			}
		}
	})
	time.Sleep(20 * time.Millisecond)
	joined := sourcetest.Follow(t, src, "/g/z/")
	wg.Wait()
	cancel()
	joined.WaitFor(t, "the last count", sourcetest.Holds(map[string]string{"n": strconv.Itoa(last)}))
	snaps, _ := joined.State()
	prev := 0
	for _, s := range snaps {
		n, _ := strconv.Atoi(string(s.Entries.ValueOf("n")))
		if n < prev {
			t.Fatalf("the joined prefix went back from %d to %d", prev, n)
		}
		prev = n
	}
	waitWatchers(t, srv, before+1)

	// One leaves: its writes are no longer published.
	stops[3](nil)
	etcdtest.Put(t, cli, "/g/d/k", "after", "/g/e/k", "after")
	first[4].WaitFor(t, "e's write", sourcetest.Holds(map[string]string{"k": "after"}))
	if snaps, _ := first[3].State(); len(snaps) != 1 {
		t.Errorf("a prefix that left published %d snapshots; want its first alone", len(snaps))
	}
	for i, stop := range stops {
		if i != 3 {
			stop(nil)
		}
	}
	src.gmu.Lock()
	groups := len(src.groups)
	src.gmu.Unlock()
	if groups != 1 { // /g/z/ still follows
		t.Errorf("%d groups run; want 1", groups)
	}
}

// TestHeldMemberLeavesTheOthers: a prefix that grows past its limits is
// reported with the error and keeps its last snapshot, while the other
// prefixes of its watch go on; back under its limits, it is read again.
func TestHeldMemberLeavesTheOthers(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	src := newSource(t, srv)
	etcdtest.Put(t, cli, "/h/small/a", "1", "/h/other/a", "1")
	small := sourcetest.FollowLimited(t, src, "/h/small/", source.Limits{MaxKeys: 2})
	other := sourcetest.Follow(t, src, "/h/other/")
	small.WaitFor(t, "small", sourcetest.Holds(map[string]string{"a": "1"}))
	other.WaitFor(t, "other", sourcetest.Holds(map[string]string{"a": "1"}))
	etcdtest.Put(t, cli, "/h/small/b", "2", "/h/small/c", "3")
	small.WaitFor(t, "over its limits", sourcetest.Failing)
	etcdtest.Put(t, cli, "/h/other/a", "2")
	other.WaitFor(t, "other goes on", sourcetest.Holds(map[string]string{"a": "2"}))
	if snaps, _ := small.State(); len(snaps) != 1 {
		t.Errorf("the held prefix published %d snapshots; want its first alone", len(snaps))
	}
	etcdtest.Put(t, cli, "/h/small/c", etcdtest.Delete)
	small.WaitFor(t, "read again under its limits", func(snaps []source.Snapshot, err error) bool {
		return err == nil && sourcetest.Holds(map[string]string{"a": "1", "b": "2"})(snaps, err)
	})
}

// TestGroupRefusedByAuthorization: a user granted each prefix alone, not
// the prefix they share, still follows them — each on a watch of its own,
// said in the log.
func TestGroupRefusedByAuthorization(t *testing.T) {
	// Ten branches: more than maxWatches, so grouped under /auth/p.
	var prefixes []string
	for i := range 10 {
		prefixes = append(prefixes, fmt.Sprintf("/auth/p%d/", i))
	}
	logs := followGranted(t, prefixes)
	if logs.Count("etcd refuses a watch of the prefix the group's mounts share") == 0 {
		t.Errorf("the refusal is not in the log:\n%s", logs)
	}
}

// TestSpanRefusedByAuthorization: the same user and 40 prefixes, which a
// start reads in spans: etcd refuses a span's range, which no grant covers,
// and the prefixes are read one by one from then on, said in the log once.
func TestSpanRefusedByAuthorization(t *testing.T) {
	// Ten branches after /auth/: one group of 40, read in spans of 3.
	var prefixes []string
	for c := 'a'; c <= 'j'; c++ {
		for d := range 4 {
			prefixes = append(prefixes, fmt.Sprintf("/auth/%c%d/", c, d))
		}
	}
	logs := followGranted(t, prefixes)
	if n := logs.Count("etcd refuses a read across the mounts' prefixes"); n != 1 {
		t.Errorf("the refusal of a span is in the log %d times; want once:\n%s", n, logs)
	}
}

// followGranted follows prefixes as a user granted each of them alone,
// each holding k=1, and checks that each gets its key, then a write; it
// returns the source's log.
func followGranted(t *testing.T, prefixes []string) *testlog.Buffer {
	t.Helper()
	srv, cli := etcdtest.Start(t)
	ctx := context.Background()
	steps := []func() error{
		func() error { _, err := cli.UserAdd(ctx, "root", "rootpw"); return err },
		func() error { _, err := cli.UserGrantRole(ctx, "root", "root"); return err },
		func() error { _, err := cli.RoleAdd(ctx, "vm"); return err },
		func() error { _, err := cli.UserAdd(ctx, "vm", "vmpw"); return err },
		func() error { _, err := cli.UserGrantRole(ctx, "vm", "vm"); return err },
	}
	for _, p := range prefixes {
		steps = append(steps,
			func() error {
				_, err := cli.RoleGrantPermission(ctx, "vm", p, clientv3.GetPrefixRangeEnd(p), clientv3.PermissionType(clientv3.PermRead))
				return err
			},
			func() error { _, err := cli.Put(ctx, p+"k", "1"); return err })
	}
	steps = append(steps, func() error { _, err := cli.AuthEnable(ctx); return err })
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	logs := &testlog.Buffer{}
	password, err := config.ReadSecretFileFrom(config.Replay{"pw": []byte("vmpw")}, "pw")
	if err != nil {
		t.Fatal(err)
	}
	src, err := New("main", &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch, DialTimeout: 2 * time.Second,
		Username: "vm", Password: password}, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	var recs []*sourcetest.Recorder
	for _, p := range prefixes {
		recs = append(recs, sourcetest.Follow(t, src, p))
	}
	for _, rec := range recs {
		rec.WaitFor(t, "first snapshot", sourcetest.Holds(map[string]string{"k": "1"}))
	}
	root, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint()}, Username: "root", Password: "rootpw", DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	for _, p := range prefixes {
		etcdtest.Put(t, root, p+"k", "2")
	}
	for _, rec := range recs {
		rec.WaitFor(t, "the write", sourcetest.Holds(map[string]string{"k": "2"}))
	}
	return logs
}

// TestCacheAttachesWatchedPrefixes: the feeds of 200 prefixes that the
// cache follows on an etcd source in watch mode run no goroutine each
// (source.Attacher) — with a goroutine per feed, each parked for the
// feed's life, the count grows by at least 200 — and still deliver; a
// released feed stops being published, and its follow's end is waited
// for.
func TestCacheAttachesWatchedPrefixes(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	const n = 200
	putPrefixKeys(t, cli, "/att/m%03d/", n)
	changed := make(chan struct{}, 1)
	cache := source.NewCache(sourcetest.Discard, func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	})
	t.Cleanup(cache.Close)
	cache.SetSources(map[string]source.Source{"main": newSource(t, srv)})
	before := runtime.NumGoroutine()
	feeds := make([]*source.Feed, n)
	for i := range n {
		f, err := cache.Acquire("main", fmt.Sprintf("/att/m%03d/", i), source.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		feeds[i] = f
	}
	value := func(f *source.Feed) string {
		if st := f.State(); st.Snapshot != nil {
			return string(st.Snapshot.Entries.ValueOf("k"))
		}
		return ""
	}
	waitValue := func(f *source.Feed, want string) {
		t.Helper()
		for deadline := time.Now().Add(sourcetest.Timeout); value(f) != want; {
			if time.Now().After(deadline) {
				t.Fatalf("a feed holds %q; want %q", value(f), want)
			}
			select {
			case <-changed:
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	for _, f := range feeds {
		waitValue(f, "v0")
	}
	// The groups' loops, the connection's and the stall monitor's
	// goroutines: a few dozen at most.
	if grew := runtime.NumGoroutine() - before; grew >= 50 {
		t.Errorf("%d goroutines more for %d followed prefixes; want fewer than 50", grew, n)
	}

	etcdtest.Put(t, cli, "/att/m017/k", "v1", "/att/m018/k", "v1")
	waitValue(feeds[17], "v1")
	cache.Release(feeds[18], source.Limits{})
	etcdtest.Put(t, cli, "/att/m018/k", "v2", "/att/m019/k", "v2")
	waitValue(feeds[19], "v2")
	if got := value(feeds[18]); got == "v2" {
		t.Errorf("a released feed was published %q", got)
	}
}
