package topology

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/source/consul"
)

// The Consul topology's bars (issue 35).
const (
	// consulStaleWithin: a frozen agent or server, a lost quorum or a
	// leaderless answer is reported stale within 5 s (the etcd source's
	// 4.5 s is the bar), and no acknowledged write stays invisible longer
	// while /status says current.
	consulStaleWithin = 5 * time.Second
	// consulCurrentWithin: current again within a second of the heal,
	// with the slack of /status sampled every 100 ms on a loaded machine.
	// A server fault heals when a write is acknowledged again and the
	// agent's answers are fresh (healed): a server restarted after a lost
	// quorum may catch up on the leader's log for a second or more after
	// the first acknowledged write, and until it does no source can call
	// its answers current.
	consulCurrentWithin = 1500 * time.Millisecond
)

// consulModes are the consistency modes, one source and mount each.
var consulModes = []string{"default", "stale", "consistent"}

// consulTopology is 3 Consul servers and a client agent, with a writer
// of transactions that go to whichever server answers.
type consulTopology struct {
	t testing.TB
	c *consultest.Cluster
	// paused holds the writer.
	paused atomic.Bool
}

// writer writes app/n and app/check, equal, in one transaction every
// 250 ms, n counting up, through whichever server accepts it (not through
// the client agent, which a fault may freeze), until ctx is done. Each
// transaction sets app/n only at the ModifyIndex the writer last saw
// (cas), so that a transaction that timed out and is applied later cannot
// put an older n over a newer one: the store's n only grows (but for a
// restore).
func (ct *consulTopology) writer(ctx context.Context, h *history) {
	n := 0
	var index uint64 // app/n's ModifyIndex as last seen; 0 before it exists
	known := false
	clients := map[string]*api.Client{}
	client := func(s *consultest.Node) *api.Client {
		if clients[s.Name] == nil {
			clients[s.Name] = s.APIClient()
		}
		return clients[s.Name]
	}
	for ctx.Err() == nil {
		time.Sleep(250 * time.Millisecond)
		if ct.paused.Load() {
			known = false
			continue
		}
		n++
		for _, s := range ct.c.Servers {
			wctx, cancel := context.WithTimeout(ctx, time.Second)
			q := (&api.QueryOptions{RequireConsistent: true}).WithContext(wctx)
			if !known {
				pair, _, err := client(s).KV().Get("app/n", q)
				if err != nil {
					cancel()
					continue
				}
				index, known = 0, true
				if pair != nil {
					index = pair.ModifyIndex
					if v, err := strconv.Atoi(string(pair.Value)); err == nil && v >= n {
						n = v + 1
					}
				}
			}
			v := []byte(strconv.Itoa(n))
			ok, resp, _, err := client(s).KV().Txn(api.KVTxnOps{
				{Verb: api.KVCAS, Key: "app/n", Value: v, Index: index},
				{Verb: api.KVSet, Key: "app/check", Value: v},
			}, q)
			cancel()
			if err == nil && ok && len(resp.Results) > 0 {
				index = resp.Results[0].ModifyIndex
				h.ack(n, time.Now())
				break
			}
			known = false // timed out, refused or lost: read app/n again
		}
	}
}

// serving waits until a write is acknowledged after since, and returns
// when.
func (ct *consulTopology) serving(h *history, since time.Time) time.Time {
	ct.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		h.mu.Lock()
		var at time.Time
		if len(h.acked) > 0 && h.acked[len(h.acked)-1].at.After(since) {
			at = h.acked[len(h.acked)-1].at
		}
		h.mu.Unlock()
		if !at.IsZero() {
			return at
		}
		if time.Now().After(deadline) {
			ct.t.Fatalf("consul does not acknowledge writes %v after the fault", waitTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// healed waits until a write is acknowledged after since and the client
// agent's answers are fresh again — a stale read through it comes from a
// server that knows a leader and heard from it within the sources'
// default max_stale, what their liveness probe asks (source/consul,
// liveness.go) — and returns when the later of the two came.
func (ct *consulTopology) healed(h *history, since time.Time) time.Time {
	ct.t.Helper()
	acked := ct.serving(h, since)
	cl := ct.c.Client.APIClient()
	deadline := time.Now().Add(waitTimeout)
	for first := true; ; first = false {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, meta, err := cl.KV().Get("app/n", (&api.QueryOptions{AllowStale: true}).WithContext(ctx))
		cancel()
		switch {
		case err != nil || !meta.KnownLeader || meta.LastContact > consul.DefaultMaxStale:
		case first:
			return acked // fresh already when the write was acknowledged
		default:
			return time.Now()
		}
		if time.Now().After(deadline) {
			ct.t.Fatalf("the client agent's answers not fresh %v after the fault (last: %v)", waitTimeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestConsulCluster runs kvmount against Consul as it runs in production:
// three servers on 127.0.0.11–13 with Consul's default timings, and a
// client agent on 127.0.0.1 that kvmount talks to, with three sources side
// by side — consistency default, stale and consistent — each projecting
// app/ into a mount of its own, while transactions rewrite app/n and
// app/check every 250 ms. The faults: the leader killed, the leader
// frozen, the client agent frozen, the server the agent forwards to
// frozen, the agent restarted with and without its data, the quorum lost
// with the leader surviving and with it gone, an older snapshot restored,
// and kvmount killed. Throughout, in every mode: never a mixed version,
// never a step backwards (but to the restored snapshot), no acknowledged
// write invisible for more than 5 s while /status says current; a fault
// that stops the store for the agent (the agent or its server frozen, the
// quorum lost) is reported stale within 5 s, and every mount is current
// again within a second of the heal; the restore is followed within
// seconds.
func TestConsulCluster(tt *testing.T) {
	t := keepFailures(tt)
	roottest.Require(t)
	ct := &consulTopology{t: t, c: consultest.StartCluster(t, 3)}
	c := ct.c
	d := newKvmountd(t, "")
	var conf strings.Builder
	for _, m := range consulModes {
		fmt.Fprintf(&conf, "[sources.%s]\ntype = \"consul\"\naddress = \"http://%s\"\nconsistency = %q\n", m, c.Client.Addr(), m)
		conf.WriteString(d.tmpfsMount(m, fmt.Sprintf("source = %q\nprefix = \"app/\"", m)))
	}
	if err := os.WriteFile(d.config, append(must(os.ReadFile(d.config)), conf.String()...), 0o644); err != nil {
		t.Fatal(err)
	}

	h := newHistory()
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
	goAll(func() { ct.writer(ctx, h) })
	ct.serving(h, time.Time{})
	d.start()
	for _, m := range consulModes {
		d.waitState(m, "current", waitTimeout)
	}
	var st states
	for _, m := range consulModes {
		goAll(func() { h.read(ctx, t, m, d.dir(m), "") })
	}
	goAll(func() { st.watch(ctx, d, consulModes...) })
	time.Sleep(2 * time.Second)

	// fault runs inject, then heal, and reports for each mode when it was
	// reported stale and when current again; healed returns when the
	// fault ended (a thaw, a restart, writes acknowledged again).
	type check struct {
		stale bool // the store stops for the agent: stale within 5 s required
	}
	fault := func(what string, chk check, inject func(), heal func() time.Time) {
		t.Helper()
		from := time.Now()
		inject()
		healed := heal()
		// Wait for every mount to hold the last acknowledged write.
		h.waitHeld(t, what, consulModes, &st)
		time.Sleep(consulCurrentWithin + 500*time.Millisecond)
		var line []string
		for _, m := range consulModes {
			stale := "not stale"
			if at, ok := st.first(m, "stale", from); ok && at.Before(healed) {
				stale = fmt.Sprintf("stale after %v", at.Sub(from).Round(time.Millisecond))
				if chk.stale && at.Sub(from) > consulStaleWithin {
					t.Errorf("%s: %s reported stale %v after the fault; want within %v", what, m, at.Sub(from).Round(time.Millisecond), consulStaleWithin)
				}
			} else if chk.stale {
				t.Errorf("%s: %s never reported stale", what, m)
			}
			current := "current throughout"
			if at, ok := st.first(m, "current", healed); ok {
				took := at.Sub(healed)
				current = fmt.Sprintf("current %v after the heal", took.Round(time.Millisecond))
				if took > consulCurrentWithin {
					t.Errorf("%s: %s current again %v after the heal; want within %v", what, m, took.Round(time.Millisecond), consulCurrentWithin)
				}
			} else {
				t.Errorf("%s: %s not current after the heal", what, m)
			}
			line = append(line, fmt.Sprintf("%s %s, %s", m, stale, current))
		}
		t.Logf("%s (healed after %v): %s", what, healed.Sub(from).Round(time.Millisecond), strings.Join(line, "; "))
	}
	// serverHealed waits for a server fault's heal from now (ct.healed).
	serverHealed := func() time.Time { return ct.healed(h, time.Now()) }
	// frozen freezes n for 10 s; the heal is the thaw, or for a server the
	// first write acknowledged after it with the agent's answers fresh
	// (healed: the cluster may need an election once the old leader is
	// back).
	frozen := func(n *consultest.Node, server bool) (func(), func() time.Time) {
		return n.Freeze, func() time.Time {
			time.Sleep(10 * time.Second)
			n.Thaw()
			if server {
				return serverHealed()
			}
			return time.Now()
		}
	}

	// The leader killed; a new one is elected; the old one restarts.
	var killed *consultest.Node
	fault("leader killed", check{}, func() { killed = c.Leader(); killed.Kill() }, func() time.Time { return serverHealed() })
	killed.Start()
	c.WaitLeader()
	// The leader frozen for 10 s.
	inject, heal := frozen(c.Leader(), true)
	fault("leader frozen", check{}, inject, heal)
	c.WaitLeader()
	// The client agent frozen for 10 s: every source stale.
	inject, heal = frozen(c.Client, false)
	fault("client agent frozen", check{stale: true}, inject, heal)
	// The client agent restarted with its data: afterwards it holds one
	// connection to a server, the one it forwards to.
	fault("client agent restarted", check{}, c.Client.Kill, func() time.Time { c.Client.Start(); return time.Now() })
	// The server the client agent forwards to frozen for 10 s.
	servers := c.Forwarding()
	var names []string
	for _, s := range servers {
		names = append(names, s.Name)
	}
	t.Logf("the client agent holds connections to %v", names)
	if len(servers) != 1 {
		t.Fatalf("the client agent holds connections to %d servers; want one", len(servers))
	}
	inject, heal = frozen(servers[0], true)
	fault("the agent's server frozen", check{stale: true}, inject, heal)
	c.WaitLeader()
	// The client agent restarted without its data.
	fault("client agent restarted without its data", check{}, func() { c.Client.Kill(); c.Client.Wipe() },
		func() time.Time { c.Client.Start(); return time.Now() })
	c.WaitLeader()
	// The quorum lost for 10 s, the leader surviving; then with it gone.
	var down []*consultest.Node
	restart := func() time.Time {
		time.Sleep(10 * time.Second)
		for _, n := range down {
			n.Start()
		}
		return serverHealed()
	}
	fault("quorum lost, the leader surviving", check{stale: true}, func() {
		leader := c.Leader()
		down = nil
		for _, s := range c.Servers {
			if s != leader {
				down = append(down, s)
				s.Kill()
			}
		}
	}, restart)
	c.WaitLeader()
	fault("quorum lost, the leader gone", check{stale: true}, func() {
		leader := c.Leader()
		down = []*consultest.Node{leader}
		for _, s := range c.Servers {
			if s != leader {
				down = append(down, s)
				break
			}
		}
		for _, n := range down {
			n.Kill()
		}
	}, restart)
	c.WaitLeader()

	// An older snapshot restored: every mode follows it within seconds.
	// The writer is held while the snapshot is taken, so that the n read
	// after it is the snapshot's (full CI once read a write that came
	// between the two: 210 for a snapshot of 209).
	cl := c.Client.APIClient()
	ct.paused.Store(true)
	time.Sleep(1500 * time.Millisecond)
	// Right after the quorum's return Raft refuses a snapshot until its
	// FSM has applied an entry past the latest configuration entry
	// ("cannot take snapshot now", full CI twice), and with the writer
	// held no entry comes by itself (hashicorp/raft's takeSnapshot counts
	// on application traffic): each refusal is followed by a write to a
	// key no mount reads, and the snapshot asked again, for up to 10 s.
	snap, _, err := cl.Snapshot().Save(nil)
	for deadline := time.Now().Add(10 * time.Second); err != nil && strings.Contains(err.Error(), "cannot take snapshot now") && time.Now().Before(deadline); {
		if _, err := cl.KV().Put(&api.KVPair{Key: "topology/snapshot-nudge", Value: []byte(time.Now().String())}, nil); err != nil {
			t.Logf("nudge before the snapshot: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
		snap, _, err = cl.Snapshot().Save(nil)
	}
	if err != nil {
		t.Fatal(err)
	}
	var saved bytes.Buffer
	if _, err := saved.ReadFrom(snap); err != nil {
		t.Fatal(err)
	}
	snap.Close()
	pair, _, err := cl.KV().Get("app/n", &api.QueryOptions{RequireConsistent: true})
	if err != nil || pair == nil {
		t.Fatalf("app/n: %v, %v", pair, err)
	}
	snapN, _ := strconv.Atoi(string(pair.Value))
	ct.paused.Store(false)
	time.Sleep(3 * time.Second)
	ct.paused.Store(true)
	time.Sleep(500 * time.Millisecond)
	done := h.restoring(snapN, time.Now().Add(-consulStaleWithin))
	restored := time.Now()
	if err := cl.Snapshot().Restore(nil, &saved); err != nil {
		t.Fatal(err)
	}
	done()
	var line []string
	for _, m := range consulModes {
		deadline := time.Now().Add(waitTimeout)
		for {
			h.mu.Lock()
			var at time.Time
			for _, r := range h.reads[m] {
				if r.at.After(restored) && r.n == snapN {
					at = r.at
					break
				}
			}
			h.mu.Unlock()
			if !at.IsZero() {
				took := at.Sub(restored)
				line = append(line, fmt.Sprintf("%s after %v", m, took.Round(time.Millisecond)))
				if took > 10*time.Second {
					t.Errorf("%s followed the restore after %v; want seconds (wait is 5m)", m, took.Round(time.Millisecond))
				}
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s never followed the restore to n = %d", m, snapN)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	t.Logf("snapshot restored (n = %d): followed by %s", snapN, strings.Join(line, ", "))
	ct.paused.Store(false)

	// kvmount killed and started again: it adopts its mounts.
	killedAt := time.Now()
	d.kill()
	h.outage("kvmount killed", killedAt, killedAt)
	d.start()
	for _, m := range consulModes {
		d.waitState(m, "current", waitTimeout)
	}
	time.Sleep(3 * time.Second)
	cancel()
	wg.Wait()
	t.Logf("states:\n%s", &st)
	for _, m := range consulModes {
		if bad := h.silentLags(m, &st, consulStaleWithin); len(bad) > 0 {
			t.Errorf("%s: %d acknowledged writes invisible for over %v while /status said current: %s", m, len(bad), consulStaleWithin,
				strings.Join(bad[:min(len(bad), 5)], "; "))
		}
		t.Logf("%s: %d reads", m, len(h.reads[m]))
	}
}
