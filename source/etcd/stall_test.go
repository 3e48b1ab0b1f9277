package etcd

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/connectivity"

	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/source"
)

// watchSubscriber returns the monitor's subscriber of src's watch of
// prefix, nil when there is none.
func watchSubscriber(src *Source, prefix string) *subscriber {
	src.mu.Lock()
	m := src.monitor
	src.mu.Unlock()
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for sub := range m.subs {
		if sub.prefix == prefix {
			return sub
		}
	}
	return nil
}

// watchMember returns the ID of the member that answered src's watch of
// prefix last.
func watchMember(src *Source, prefix string) uint64 {
	if sub := watchSubscriber(src, prefix); sub != nil {
		return sub.member.Load()
	}
	return 0
}

// TestFrozenMemberIsNoticed freezes (SIGSTOP) the member of a real
// 3-member cluster that serves the watch, while the two others take a write
// every 50 ms: within 5 s the prefix is reported stale (the review saw
// nothing reported for the whole 10–30 s freeze), the watch resumes on
// another member, and the writes reach the snapshots while the member is
// still frozen; it is reported current again.
func TestFrozenMemberIsNoticed(t *testing.T) {
	cl := etcdtest.StartCluster(t, 3)
	// One read of the group's prefixes at the start, and none after the
	// stall — the watch resumes where it stood.
	src, rec, cli, reads := followApp(t, cl, cl.Endpoints(), sourcetest.Discard)
	var id uint64
	for deadline := time.Now().Add(sourcetest.Timeout); id == 0; time.Sleep(10 * time.Millisecond) {
		if id = watchMember(src, "/app/"); id == 0 && time.Now().After(deadline) {
			t.Fatal("the watch never heard from a member")
		}
	}
	serving := cl.ByID(t, cli, id)
	var others []*etcdtest.Member
	for _, m := range cl.Members {
		if m != serving {
			others = append(others, m)
		}
	}
	writer := cl.Client(t, others...)
	serving.Freeze(t)
	t.Cleanup(func() { serving.Thaw(t) })
	frozen := time.Now()
	var last atomic.Int64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := int64(1); ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			if _, err := writer.Put(ctx, "/app/a", strconv.FormatInt(i, 10)); err == nil {
				last.Store(i)
			}
			cancel()
		}
	}()
	defer func() { close(stop); <-done }()

	rec.WaitFor(t, "reported stale", sourcetest.Failing)
	noticed := time.Since(frozen)
	t.Logf("the frozen member was noticed %v after the freeze", noticed.Round(10*time.Millisecond))
	if noticed > 5*time.Second {
		t.Errorf("the stall was noticed after %v; want within 5 s", noticed)
	}
	// The watch resumes elsewhere while the member is still frozen.
	for deadline := time.Now().Add(sourcetest.Timeout); ; time.Sleep(20 * time.Millisecond) {
		snaps, err := rec.State()
		if n := last.Load(); n > 20 && err == nil && len(snaps) > 0 {
			if v, _ := strconv.ParseInt(string(snaps[len(snaps)-1].Entries.ValueOf("a")), 10, 64); v >= 20 {
				t.Logf("resumed on another member %v after the freeze, at a=%d (%d writes so far)", time.Since(frozen).Round(10*time.Millisecond), v, n)
				break
			}
		}
		if time.Now().After(deadline) {
			snaps, err := rec.State()
			t.Fatalf("the watch never resumed: last snapshot %v, status %v, %d writes", fmt.Sprint(sourcetest.Last(snaps).Entries.Map()), err, last.Load())
		}
	}
	if watchMember(src, "/app/") == id {
		t.Error("the watch still names the frozen member")
	}
	if n := reads.Load(); n != 1 {
		t.Errorf("the group's prefixes were read %d times; want once (at the start): the stalled watch resumes rather than re-reads", n)
	}
	if s := watchStream(src, "/app/"); s == 0 {
		t.Error("the resumed watch is on the stream of the stalled one; want a stream of its own")
	}
}

// followApp follows /app/ with a watch-mode source of cl's endpoints
// that logs to log, and waits until it holds a=0, written through a
// client of every member (cli); reads counts the reads of the group's
// prefixes (testHookAfterList) from the start.
func followApp(t *testing.T, cl *etcdtest.Cluster, endpoints []string, log *slog.Logger) (src *Source, rec *sourcetest.Recorder, cli *clientv3.Client, reads *atomic.Int64) {
	t.Helper()
	src, err := New("main", &Config{Endpoints: endpoints, DialTimeout: 2 * time.Second, ChangeDetection: Watch}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	reads = &atomic.Int64{}
	testHookAfterList = func() { reads.Add(1) }
	t.Cleanup(func() { testHookAfterList = nil })
	rec = sourcetest.Follow(t, src, "/app/")
	cli = cl.Client(t)
	etcdtest.Put(t, cli, "/app/a", "0")
	rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "0"}))
	return src, rec, cli, reads
}

// watchStream returns the number of the stream src's watch of prefix is
// on (monitor.watchContext).
func watchStream(src *Source, prefix string) uint64 {
	if sub := watchSubscriber(src, prefix); sub != nil {
		return sub.stream
	}
	return 0
}

// TestUnansweredProgressIsNoStall keeps the member from answering progress
// requests while it is alive and well — a watcher on the same stream that
// starts at a revision the store has not reached, which etcd's
// progressIfSync waits for, as it waits for watchers still catching up
// when a thousand watches are created at a cold start — and checks that
// the prefix is never reported stale: the status probe finds the member
// answering. (Before the probe, a busy cold start of 1,000 prefixes
// reported them all stalled and restarted every watch, again and again.)
// Writes still arrive.
func TestUnansweredProgressIsNoStall(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "/app/a", "0")
	src, err := New("main", &Config{Endpoints: []string{srv.Endpoint()}, DialTimeout: 2 * time.Second, ChangeDetection: Watch}, sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	rec := sourcetest.Follow(t, src, "/app/")
	rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "0"}))
	src.mu.Lock()
	own, mon := src.client, src.monitor
	src.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The same context metadata as the source's watch: the same stream.
	own.Watch(streamContext(ctx, watchStream(src, "/app/")), "/future/", clientv3.WithPrefix(), clientv3.WithRev(1<<40))

	deadline := time.Now().Add(sourcetest.Timeout)
	for mon.statusProbes.Load() < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("no status probe after %d progress requests: the progress requests were answered", mon.progressRequests.Load())
		}
		time.Sleep(50 * time.Millisecond)
	}
	etcdtest.Put(t, cli, "/app/a", "1")
	rec.WaitFor(t, "a write after the probes", sourcetest.Holds(map[string]string{"a": "1"}))
	if errs := rec.Errors(); len(errs) > 0 {
		t.Errorf("a live member was reported: %v", errs)
	}
	t.Logf("%d progress requests, %d rounds of status probes, no stall reported", mon.progressRequests.Load(), mon.statusProbes.Load())
}

// BenchmarkIdleStallDetection measures what stall detection costs etcd
// when nothing changes: 100 sources (as 100 daemons would: a client, a
// connection and a watch stream each), two prefixes each, idle against one
// etcd member running as its own process. Over a 15 s window after they
// settle it reports the progress requests each source sent per second
// (progress-req/s/daemon) and the member's CPU (user + system, from
// /proc/PID/stat) per second and per daemon (member-cpu-us/s/daemon),
// against the same window with the same 100 sources' connections open but
// no watches (idle-cpu-us/s/daemon). b.N is ignored: one measurement (run
// with -benchtime 1x).
func BenchmarkIdleStallDetection(b *testing.B) {
	const daemons, window = 100, 15 * time.Second
	cl := etcdtest.StartCluster(b, 1)
	pid := cl.Members[0].Pid()
	cpu := func() time.Duration {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			b.Fatal(err)
		}
		// Fields after the command's closing parenthesis: utime is the
		// 14th field of the line, stime the 15th (proc(5)).
		f := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+2:]))
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		return time.Duration(ut+st) * time.Second / 100 // USER_HZ
	}
	measure := func() time.Duration {
		c0 := cpu()
		time.Sleep(window)
		return cpu() - c0
	}
	// The same connections without watches: keepalives only.
	var clients []*clientv3.Client
	for range daemons {
		cli := cl.Client(b)
		if _, err := cli.Get(context.Background(), "/warm"); err != nil {
			b.Fatal(err)
		}
		clients = append(clients, cli)
	}
	time.Sleep(3 * time.Second)
	idle := measure()
	for _, cli := range clients {
		cli.Close()
	}
	var sources []*Source
	for d := range daemons {
		src, err := New("main", &Config{Endpoints: cl.Endpoints(), DialTimeout: 2 * time.Second, ChangeDetection: Watch}, sourcetest.Discard)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { src.Close() })
		sourcetest.Follow(b, src, fmt.Sprintf("/d%03d/a/", d))
		sourcetest.Follow(b, src, fmt.Sprintf("/d%03d/b/", d))
		sources = append(sources, src)
	}
	time.Sleep(3 * time.Second)
	requests := func() (n int64) {
		for _, src := range sources {
			src.mu.Lock()
			if m := src.monitor; m != nil {
				n += m.progressRequests.Load() + m.statusProbes.Load()
			}
			src.mu.Unlock()
		}
		return n
	}
	r0 := requests()
	b.ResetTimer()
	watching := measure()
	b.StopTimer()
	perDaemon := func(d time.Duration) float64 {
		return float64(d.Microseconds()) / window.Seconds() / daemons
	}
	b.ReportMetric(float64(requests()-r0)/window.Seconds()/daemons, "progress-req/s/daemon")
	b.ReportMetric(perDaemon(watching), "member-cpu-us/s/daemon")
	b.ReportMetric(perDaemon(idle), "idle-cpu-us/s/daemon")
}

// statusLog records what a subscriber is told.
type statusLog struct {
	mu  sync.Mutex
	got []error
}

func (l *statusLog) Status(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.got = append(l.got, err)
}

// TestResumedWatchStaysStale checks that the watch started again after a
// stall stays reported stale until it hears from a member itself: the
// client's connection is ready while any member answers, the frozen one
// included, and a ready connection reported the resumed watch current
// while its writes stayed invisible (TestEtcdGRPCProxy, 6.3 s).
func TestResumedWatchStaysStale(t *testing.T) {
	m := &monitor{state: connectivity.Ready, subs: map[*subscriber]struct{}{}}
	var fresh, resumed statusLog
	m.subscribe("/a/", &fresh, 0, false)
	sub := m.subscribe("/b/", &resumed, 1, true)
	m.mu.Lock()
	m.report(sub)
	m.mu.Unlock()
	if len(fresh.got) != 1 || fresh.got[0] != nil {
		t.Errorf("a new watch on a ready connection was told %v; want current once", fresh.got)
	}
	if len(resumed.got) != 0 {
		t.Fatalf("a resumed watch that heard nothing yet was told %v; want nothing (it stays stale)", resumed.got)
	}
	sub.touch(7)
	m.mu.Lock()
	m.report(sub)
	m.mu.Unlock()
	if len(resumed.got) != 0 {
		t.Fatalf("a resumed watch whose member only took it was told %v; want nothing", resumed.got)
	}
	if !sub.hear(7) {
		t.Error("hear after the resume did not report the watch current again")
	}
	m.mu.Lock()
	m.report(sub)
	m.mu.Unlock()
	if len(resumed.got) != 1 || resumed.got[0] != nil {
		t.Errorf("a resumed watch that heard its member was told %v; want current", resumed.got)
	}

	// A watch reported stalled that clientv3 resumes itself, on the same
	// member come back (TestOutageKeepsLastSnapshot), is current when the
	// connection is ready again: it resumes past the store's revision,
	// where etcd answers no progress request until the next write.
	var waiting statusLog
	same := m.subscribe("/c/", &waiting, 0, false)
	same.stalledErr.Store(true)
	m.mu.Lock()
	m.report(same)
	m.mu.Unlock()
	if len(waiting.got) != 2 || waiting.got[1] != nil {
		t.Errorf("a stalled watch on a ready connection was told %v; want current", waiting.got)
	}
}

// TestLeaderlessMemberResumes takes from the member that serves the watch
// its two peers (SIGKILL): the member loses its leader, and etcd ends the
// watch (WithRequireLeader: "etcdserver: no leader"). The prefix is
// reported stale meanwhile, and once the peers are back the watch resumes
// from where it stood, reading nothing again — a lost quorum makes a
// fleet resume, not re-read (issue 37's herds; before, every daemon on the
// member read its prefixes again). A write made after the quorum is back
// arrives. Lost the second time for longer, the tries to resume grow to
// resumeRetryMax and no further, and the write after the quorum's return
// arrives within that wait.
func TestLeaderlessMemberResumes(t *testing.T) {
	cl := etcdtest.StartCluster(t, 3)
	logs := &testlog.Buffer{}
	_, rec, cli, reads := followApp(t, cl, []string{cl.Members[0].ClientURL}, slog.New(slog.NewTextHandler(logs, nil)))

	for _, m := range cl.Members[1:] {
		m.Kill()
	}
	lost := time.Now()
	rec.WaitFor(t, "reported stale without a leader", sourcetest.Failing)
	t.Logf("reported stale %v after the peers were killed", time.Since(lost).Round(10*time.Millisecond))
	// Long enough for etcd to end the watch for want of a leader (three
	// election timeouts of 1 s, etcd's monitorLeader) and for the group
	// to try again at least once. No try says current: the error a
	// resumed watch is refused with is no word that it delivers (a
	// flicker to current that /status showed, and a caller waiting for
	// current took).
	currents := rec.Currents()
	time.Sleep(6 * time.Second)
	if n := rec.Currents() - currents; n > 0 {
		t.Errorf("reported current %d times while the quorum was lost; want never", n)
	}
	for _, m := range cl.Members[1:] {
		m.Restart(t)
	}
	etcdtest.Put(t, cli, "/app/a", "1")
	rec.WaitFor(t, "the write after the quorum came back", sourcetest.Holds(map[string]string{"a": "1"}))
	rec.WaitFor(t, "reported current", func(_ []source.Snapshot, err error) bool { return err == nil })
	if n := reads.Load(); n != 1 {
		t.Errorf("the group's prefixes were read %d times; want once (at the start): a watch ended for want of a leader resumes rather than re-reads", n)
	}
	out := logs.String()
	if !strings.Contains(out, "no leader") || !strings.Contains(out, "resume_from=") {
		t.Fatalf("the log says nothing of a watch ended for want of a leader, to be resumed:\n%s", out)
	}
	first := retryDelays(out)
	if len(first) < 2 || slices.Max(first) < time.Second {
		t.Fatalf("retries during the first loss waited %v; want them to back off past 1 s (the test relies on it)", first)
	}

	// The quorum lost again: the watch that was established meanwhile
	// started the backoff again from its shortest (RetryMin ±20 %),
	// where the group's backoff used to keep growing over its life.
	for _, m := range cl.Members[1:] {
		m.Kill()
	}
	for deadline := time.Now().Add(sourcetest.Timeout); len(retryDelays(logs.String())) == len(first); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the second loss of the quorum was never logged:\n%s", logs.String())
		}
	}
	d := retryDelays(logs.String())[len(first)]
	t.Logf("retries during the first loss waited %v; the first after the second loss %v", first, d)
	if d > source.RetryMin*6/5 {
		t.Errorf("the first retry after the second loss waits %v (the first loss's waited %v); want at most %v: the backoff starts again once a watch is established", d, first, source.RetryMin*6/5)
	}
	// Lost for longer, the tries to resume wait at most resumeRetryMax
	// (±10 %), where a read's backoff goes on to source.RetryMax: the
	// quorum's return is found within it.
	for deadline := time.Now().Add(60 * time.Second); len(retryDelays(logs.String())) < len(first)+7; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("fewer than 7 tries in 60 s of the second loss: %v", retryDelays(logs.String())[len(first):])
		}
	}
	second := retryDelays(logs.String())[len(first):]
	t.Logf("the second loss's tries waited %v", second)
	if slices.Max(second) > resumeRetryMax*11/10 || second[len(second)-1] < resumeRetryMax*9/10 {
		t.Errorf("the second loss's tries waited %v; want them to grow to %v ±10 %% and no further", second, resumeRetryMax)
	}
	for _, m := range cl.Members[1:] {
		m.Restart(t)
	}
	etcdtest.Put(t, cli, "/app/a", "2")
	back := time.Now()
	rec.WaitFor(t, "the write after the second loss", sourcetest.Holds(map[string]string{"a": "2"}))
	t.Logf("the write after the second loss arrived %v after it was acknowledged", time.Since(back).Round(10*time.Millisecond))
	if took := time.Since(back); took > resumeRetryMax*11/10+2*time.Second {
		t.Errorf("the write after the second loss arrived %v after it was acknowledged; want within the longest wait to resume (%v ±10 %%) and 2 s", took, resumeRetryMax)
	}
	if n := reads.Load(); n != 1 {
		t.Errorf("after the second loss the group's prefixes were read %d times; want once", n)
	}
}

// retryDelays returns the retry_in of every "source unavailable" line of
// a text log, in order.
func retryDelays(log string) []time.Duration {
	var out []time.Duration
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, "source unavailable") {
			continue
		}
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "retry_in="); ok {
				if d, err := time.ParseDuration(v); err == nil {
					out = append(out, d)
				}
			}
		}
	}
	return out
}
