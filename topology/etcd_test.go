package topology

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/roottest"
)

// etcdStaleWithin is the etcd source's bar for reporting a silent member
// stale: ProgressIdle + ProgressTimeout + ProbeTimeout (4.5 s), with the
// slack of /status sampled every 100 ms on a loaded machine.
const etcdStaleWithin = 5 * time.Second

// etcdMounts are the mounts of TestEtcdGRPCProxy: "direct" from a source
// of the members' endpoints, "proxy" from a source of the gRPC proxy's.
var etcdMounts = []string{"direct", "proxy"}

// etcdWriter writes /app/n and /app/check, equal, in one transaction every
// 250 ms through cli (the members), n counting up, until ctx is done;
// paused holds it. Each transaction applies only if /app/n is still at
// the revision the writer last saw, so that one that timed out on a
// frozen member and is applied after its thaw cannot put an older n over
// a newer one: the store's n only grows.
func etcdWriter(ctx context.Context, cli *clientv3.Client, h *history, paused *atomic.Bool) {
	n := 0
	var rev int64 // /app/n's ModRevision as last seen; 0 before it exists
	known := false
	for ctx.Err() == nil {
		time.Sleep(250 * time.Millisecond)
		if paused.Load() {
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, time.Second)
		if !known {
			resp, err := cli.Get(wctx, "/app/n")
			if err != nil {
				cancel()
				continue
			}
			rev, known = 0, true
			if len(resp.Kvs) > 0 {
				rev = resp.Kvs[0].ModRevision
				if v, err := strconv.Atoi(string(resp.Kvs[0].Value)); err == nil && v > n {
					n = v
				}
			}
		}
		n++
		v := strconv.Itoa(n)
		resp, err := cli.Txn(wctx).If(clientv3.Compare(clientv3.ModRevision("/app/n"), "=", rev)).
			Then(clientv3.OpPut("/app/n", v), clientv3.OpPut("/app/check", v)).Commit()
		cancel()
		if err != nil || !resp.Succeeded {
			known = false // timed out, lost or raced: read /app/n again
			continue
		}
		rev = resp.Header.Revision
		h.ack(n, time.Now())
	}
}

// TestEtcdGRPCProxy runs kvmount through etcd's gRPC proxy, the engine
// etcd documents for many clients watching the same keys, beside a source
// that reaches the three members directly, while a writer rewrites /app/n
// and /app/check in one transaction every 250 ms. The faults: the leader
// killed and restarted, each member frozen for 10 s in turn (one of them
// serves the proxy's watches), the quorum lost for 8 s (the direct
// source's watch ended "no leader" resumes, reading nothing again), the
// proxy frozen, the proxy killed while the store is compacted past the
// mount's revision and started again, and kvmount killed. Throughout, for both mounts: never a mixed version,
// never backwards, no acknowledged write invisible for more than 5 s
// while /status says current — but for the proxy's mount while a member
// behind the proxy is frozen. That is what the proxy hides: with the proxy
// its only endpoint kvmount cannot go elsewhere, the proxy leaves the
// member only when gRPC's keepalive (10 s at least) gives up on it, and
// whether kvmount even reports the mount stale depends on whether its
// progress request reaches the frozen member (in most runs it did, after
// 4.4–7.4 s; in one it did not). The figures are logged.
func TestEtcdGRPCProxy(tt *testing.T) {
	t := keepFailures(tt)
	roottest.Require(t)
	c := etcdtest.StartCluster(t, 3)
	// The keepalive README recommends: the proxy drops a connection to a
	// member that stopped answering within 2 + 2 s and watches elsewhere.
	proxy := etcdtest.StartProxy(t, c, "--dial-keepalive-time", "2s", "--dial-keepalive-timeout", "2s")
	d := newKvmountd(t, "")
	var conf strings.Builder
	fmt.Fprintf(&conf, "[sources.direct]\ntype = \"etcd\"\nendpoints = [%s]\n", quoted(c.Endpoints()))
	fmt.Fprintf(&conf, "[sources.proxy]\ntype = \"etcd\"\nendpoints = [\"http://%s\"]\n", proxy.Addr)
	for _, m := range etcdMounts {
		conf.WriteString(d.tmpfsMount(m, fmt.Sprintf("source = %q\nprefix = \"/app/\"", m)))
	}
	if err := os.WriteFile(d.config, append(must(os.ReadFile(d.config)), conf.String()...), 0o644); err != nil {
		t.Fatal(err)
	}

	h := newHistory()
	cli := c.Client(t)
	var paused atomic.Bool
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	goAll := func(fs ...func()) {
		for _, f := range fs {
			wg.Add(1)
			go func() { defer wg.Done(); f() }()
		}
	}
	goAll(func() { etcdWriter(ctx, cli, h, &paused) })
	d.start()
	for _, m := range etcdMounts {
		d.waitState(m, "current", waitTimeout)
	}
	var st states
	for _, m := range etcdMounts {
		goAll(func() { h.read(ctx, t, m, d.dir(m), "") })
	}
	goAll(func() { st.watch(ctx, d, etcdMounts...) })
	time.Sleep(2 * time.Second)

	// caughtUp waits until every mount holds the last acknowledged write
	// and returns how long the slower took.
	caughtUp := func(what string) time.Duration {
		t.Helper()
		from := time.Now()
		h.waitHeld(t, what, etcdMounts, &st)
		return time.Since(from)
	}
	// report logs, for each mount, whether and when it was reported stale
	// from from, and when current again after healed.
	report := func(what string, from, healed time.Time) map[string]time.Duration {
		stale := map[string]time.Duration{}
		var line []string
		for _, m := range etcdMounts {
			s := "not stale"
			if at, ok := st.first(m, "stale", from); ok && at.Before(healed.Add(time.Second)) {
				stale[m] = at.Sub(from)
				s = fmt.Sprintf("stale after %v", at.Sub(from).Round(time.Millisecond))
			}
			if at, ok := st.first(m, "current", healed); ok {
				s += fmt.Sprintf(", current %v after the heal", at.Sub(healed).Round(time.Millisecond))
			}
			line = append(line, m+" "+s)
		}
		t.Logf("%s (healed after %v): %s", what, healed.Sub(from).Round(time.Millisecond), strings.Join(line, "; "))
		return stale
	}

	// The leader killed, then restarted: both mounts follow the writes of
	// the new leader.
	leader := func() *etcdtest.Member {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := cli.Status(ctx, c.Members[0].ClientURL)
		if err != nil {
			t.Fatal(err)
		}
		return c.ByID(t, cli, resp.Leader)
	}
	from := time.Now()
	l := leader()
	l.Kill()
	time.Sleep(5 * time.Second)
	l.Restart(t)
	took := caughtUp("the leader killed")
	report("leader killed, restarted after 5 s", from, time.Now())
	t.Logf("leader killed: caught up %v after its restart", took.Round(time.Millisecond))
	time.Sleep(2 * time.Second)

	// Each member frozen for 10 s in turn: one of them serves the proxy's
	// watch. The direct source notices its own member within 4.5 s; the
	// proxy's keepalive moves its watch within about 4 s.
	for _, m := range c.Members {
		from := time.Now()
		m.Freeze(t)
		time.Sleep(10 * time.Second)
		m.Thaw(t)
		healed := time.Now()
		// What the proxy hides: with the proxy its only endpoint, the
		// proxy's mount may lag as long as the freeze, reported stale or
		// not (README); its silent lags are not judged here.
		h.unjudgedOf("proxy", "member "+m.Name+" frozen behind the proxy", from, healed)
		caughtUp("member " + m.Name + " frozen")
		report("member "+m.Name+" frozen 10 s", from, healed)
		for _, mount := range etcdMounts {
			t.Logf("member %s frozen: %s showed the writes acknowledged meanwhile at most %v late", m.Name, mount, h.lagWithin(mount, from, healed).Round(time.Millisecond))
		}
		time.Sleep(2 * time.Second)
	}

	// The quorum lost for 8 s: two members killed, then restarted. The
	// survivor has no leader, and etcd ends every watch made
	// WithRequireLeader on it ("etcdserver: no leader"): the direct mount
	// is reported stale, and its watch resumes from where it stood once a
	// leader is back, reading nothing again (the log's resume_from). No
	// write is acknowledged meanwhile. What the proxy's mount does is
	// logged, not judged: the proxy's own watch is between.
	from = time.Now()
	for _, m := range c.Members[1:] {
		m.Kill()
	}
	time.Sleep(8 * time.Second)
	for _, m := range c.Members[1:] {
		m.Restart(t)
	}
	healed := time.Now()
	took = caughtUp("the quorum lost")
	// The direct watch resumes at its next retry after a leader is
	// back: within its backoff, which the outage grew (0.5 s doubling).
	for _, m := range etcdMounts {
		d.waitState(m, "current", waitTimeout)
	}
	time.Sleep(2 * time.Second)
	stale := report("quorum lost 8 s", from, healed)
	t.Logf("quorum lost: caught up %v after the members' restart", took.Round(time.Millisecond))
	if _, ok := stale["direct"]; !ok {
		t.Errorf("the lost quorum: the direct mount was never reported stale")
	}
	if d.logs.Count("no leader", "source=direct") == 0 || d.logs.Count("resume_from", "source=direct") == 0 {
		t.Errorf("no log line of the direct source's watch ended for want of a leader and resumed:\n%s", d.logs.String())
	}

	// The proxy frozen for 10 s: the proxy's mount is reported stale
	// within 5 s and current within 1.5 s of the thaw.
	from = time.Now()
	proxy.Freeze()
	time.Sleep(10 * time.Second)
	proxy.Thaw()
	healed = time.Now()
	h.outageOf("proxy", "proxy frozen", from, healed)
	caughtUp("the proxy frozen")
	time.Sleep(2 * time.Second)
	stale = report("proxy frozen 10 s", from, healed)
	if s, ok := stale["proxy"]; !ok || s > etcdStaleWithin {
		t.Errorf("the frozen proxy: the proxy's mount reported stale after %v (0: never); want within %v", s, etcdStaleWithin)
	}
	if at, ok := st.first("proxy", "current", healed); !ok || at.Sub(healed) > 1500*time.Millisecond {
		t.Errorf("the thawed proxy: the proxy's mount current again after %v; want within 1.5 s", at.Sub(healed))
	}
	if _, ok := stale["direct"]; ok {
		t.Errorf("the frozen proxy: the direct mount was reported stale")
	}

	// The proxy killed; meanwhile more writes and a compaction past the
	// proxy's mount's revision; the proxy started again: the mount's watch
	// resumes at a compacted revision, and it is read again.
	from = time.Now()
	proxy.Kill()
	time.Sleep(3 * time.Second)
	cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
	resp, err := cli.Get(cctx, "/app/n")
	if err == nil {
		_, err = cli.Compact(cctx, resp.Header.Revision, clientv3.WithCompactPhysical())
	}
	ccancel()
	if err != nil {
		t.Fatal(err)
	}
	proxy.Start()
	healed = time.Now()
	h.outageOf("proxy", "proxy killed", from, healed)
	took = caughtUp("the proxy killed over a compaction")
	time.Sleep(2 * time.Second)
	stale = report("proxy killed 3 s, compacted meanwhile", from, healed)
	if _, ok := stale["proxy"]; !ok {
		t.Errorf("the killed proxy: its mount was never reported stale")
	}
	t.Logf("proxy restarted over a compaction: caught up %v after", took.Round(time.Millisecond))
	if d.logs.Count("re-reading", "source=proxy", "compacted") == 0 {
		t.Errorf("no log line of the proxy's source re-reading after the compaction")
	}

	// kvmount killed and started again.
	d.kill()
	d.start()
	for _, m := range etcdMounts {
		d.waitState(m, "current", waitTimeout)
	}
	caughtUp("kvmount restarted")
	time.Sleep(2 * time.Second)
	cancel()
	wg.Wait()
	t.Logf("states:\n%s", &st)
	for _, m := range etcdMounts {
		if bad := h.silentLags(m, &st, etcdStaleWithin); len(bad) > 0 {
			t.Errorf("%s: %d acknowledged writes invisible for over %v while /status said current: %s", m, len(bad), etcdStaleWithin,
				strings.Join(bad[:min(len(bad), 5)], "; "))
		}
		late, longest := h.lags(m, 12*time.Second)
		if len(late) > 0 {
			t.Errorf("%s: %d writes seen more than 12 s late: %s", m, len(late), strings.Join(late[:min(len(late), 5)], "; "))
		}
		t.Logf("%s: %d reads, longest lag %v", m, len(h.reads[m]), longest.Round(time.Millisecond))
	}
}

// quoted returns ss as the elements of a TOML array of strings.
func quoted(ss []string) string {
	q := make([]string, len(ss))
	for i, s := range ss {
		q[i] = strconv.Quote(s)
	}
	return strings.Join(q, ", ")
}
