package consul

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/sourcetest"
)

// waitState waits until rec's status is failing (want true) or healthy,
// and returns how long that took; it fails the test after limit.
func waitState(t *testing.T, rec *sourcetest.Recorder, failing bool, limit time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		_, err := rec.State()
		if (err != nil) == failing {
			return time.Since(start)
		}
		if time.Since(start) > limit {
			t.Fatalf("status %v after %v; want failing = %v", err, limit, failing)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestFrozenAgentIsNoticed: an agent stopped with SIGSTOP answers nothing,
// and its parked blocking query says nothing either: the liveness probe
// reports the prefix stale within 5 s (the etcd source's bar), and current
// again within a second of SIGCONT, with a change made meanwhile read.
func TestFrozenAgentIsNoticed(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	consultest.Txn(t, client, "app/a", "1")
	rec := follow(t, watchConfig(agent.Addr()), "app/")
	rec.WaitFor(t, "initial snapshot", sourcetest.Holds(map[string]string{"a": "1"}))
	time.Sleep(1500 * time.Millisecond) // the query is parked

	if err := syscall.Kill(agent.PID(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	took := waitState(t, rec, true, 10*time.Second)
	t.Logf("stale %v after SIGSTOP", took.Round(time.Millisecond))
	if took > 5*time.Second {
		t.Errorf("stale %v after the agent froze; want within 5 s", took)
	}
	if _, err := rec.State(); !strings.Contains(err.Error(), "no answer from the agent") {
		t.Errorf("status %v; want it to say the agent does not answer", err)
	}
	if err := syscall.Kill(agent.PID(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	took = waitState(t, rec, false, 10*time.Second)
	t.Logf("current %v after SIGCONT", took.Round(time.Millisecond))
	if took > 1500*time.Millisecond {
		t.Errorf("current %v after the agent thawed; want within a second", took)
	}
	consultest.Txn(t, client, "app/a", "2")
	rec.WaitFor(t, "a change after the thaw", sourcetest.Holds(map[string]string{"a": "2"}))
}

// TestSnapshotRestoreFollowed: a snapshot restored over newer keys lowers
// the store's index; the parked blocking query returns with its old index
// and nothing new. The return is confirmed with a non-blocking read, so
// the restored keys are in the snapshot within seconds, not after wait.
func TestSnapshotRestoreFollowed(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	consultest.Txn(t, client, "app/a", "old", "app/b", "old")
	snap, _, err := client.Snapshot().Save(nil)
	if err != nil {
		t.Fatal(err)
	}
	var saved bytes.Buffer
	if _, err := saved.ReadFrom(snap); err != nil {
		t.Fatal(err)
	}
	snap.Close()
	consultest.Txn(t, client, "app/a", "new", "app/c", "added")
	cfg := watchConfig(agent.Addr())
	rec := follow(t, cfg, "app/")
	rec.WaitFor(t, "the newer keys", sourcetest.Holds(map[string]string{"a": "new", "b": "old", "c": "added"}))
	time.Sleep(1500 * time.Millisecond) // the query is parked
	restored := time.Now()
	if err := client.Snapshot().Restore(nil, &saved); err != nil {
		t.Fatal(err)
	}
	rec.WaitFor(t, "the restored keys", sourcetest.Holds(map[string]string{"a": "old", "b": "old"}))
	took := time.Since(restored)
	t.Logf("restored keys in the snapshot %v after the restore", took.Round(time.Millisecond))
	if took > 10*time.Second {
		t.Errorf("the restore was followed after %v; want seconds (wait is %v)", took, cfg.Wait)
	}
}

// laggingAgent is a fake agent whose listings carry an index and a value
// the test sets, separately for reads that may lag and for consistent
// ones (?consistent), as a survivor that lags the leader would answer.
type laggingAgent struct {
	mu            sync.Mutex
	lagging       int // index and value of a read that may lag
	consistent    int // index and value of a consistent read; 0 fails it
	consistent500 atomic.Int64
}

func (a *laggingAgent) set(lagging, consistent int) {
	a.mu.Lock()
	a.lagging, a.consistent = lagging, consistent
	a.mu.Unlock()
}

func (a *laggingAgent) serve(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	n := a.lagging
	if r.URL.Query().Has("consistent") {
		n = a.consistent
	}
	a.mu.Unlock()
	if n == 0 {
		a.consistent500.Add(1)
		http.Error(w, "No cluster leader", http.StatusInternalServerError)
		return
	}
	if idx := r.URL.Query().Get("index"); idx == fmt.Sprint(n) {
		select { // a blocking query on the current index: wait a little
		case <-r.Context().Done():
			return
		case <-time.After(200 * time.Millisecond):
		}
	}
	w.Header().Set("X-Consul-Index", fmt.Sprint(n))
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `[{"Key":"m/v","Value":%q,"ModifyIndex":%d}]`, base64.StdEncoding.EncodeToString([]byte(fmt.Sprint(n))), n)
}

// TestNeverBackwards: a listing below the highest index published is
// published only once a consistent read confirms it — a survivor that
// lags is left out (the consistent read is newer), a restore is followed
// (the consistent read is lower too), and while no consistent read
// answers, the prefix is stale and keeps its content.
func TestNeverBackwards(t *testing.T) {
	a := &laggingAgent{}
	a.set(10, 10)
	srv := httptest.NewServer(fakeAgent(a.serve))
	t.Cleanup(srv.Close)
	cfg := watchConfig(strings.TrimPrefix(srv.URL, "http://"))
	cfg.Consistency = ConsistencyStale
	src, err := New("main", cfg, sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	rec := sourcetest.Follow(t, src, "m/")
	rec.WaitFor(t, "v = 10", sourcetest.Holds(map[string]string{"v": "10"}))

	// A lagging server answers 9, and no consistent read can be made.
	a.set(9, 0)
	rec.WaitFor(t, "stale", sourcetest.Failing)
	time.Sleep(500 * time.Millisecond)
	// A lagging server answers 9; the consistent read says 11.
	a.set(9, 11)
	rec.WaitFor(t, "v = 11", sourcetest.Holds(map[string]string{"v": "11"}))
	// The store goes back to 5, and the consistent read says so.
	a.set(5, 5)
	rec.WaitFor(t, "the restore's v = 5", sourcetest.Holds(map[string]string{"v": "5"}))

	snaps, _ := rec.State()
	var seen []string
	for _, s := range snaps {
		seen = append(seen, string(s.Entries.ValueOf("v")))
	}
	if got := strings.Join(seen, " "); got != "10 11 5" {
		t.Errorf("published %q; want 10 11 5 (never the lagging 9)", got)
	}
	if a.consistent500.Load() == 0 {
		t.Error("no consistent read was refused while the server lagged")
	}
}

// TestLeaderlessAnswerIsStale: an answer from a server that knows no
// leader, or last heard from it longer than max_stale ago, makes the
// prefix stale within 5 s in every mode (the probe reads in stale mode);
// in stale mode the listing itself is refused too.
func TestLeaderlessAnswerIsStale(t *testing.T) {
	for _, mode := range []string{ConsistencyDefault, ConsistencyStale, ConsistencyConsistent} {
		t.Run(mode, func(t *testing.T) {
			var known atomic.Bool
			var contact atomic.Int64
			known.Store(true)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Consul-KnownLeader", fmt.Sprint(known.Load()))
				w.Header().Set("X-Consul-LastContact", fmt.Sprint(contact.Load()))
				w.Header().Set("X-Consul-Index", "4")
				if !r.URL.Query().Has("recurse") {
					w.WriteHeader(http.StatusNotFound)
					return
				}
				listOneKey(w, r)
			}))
			t.Cleanup(srv.Close)
			cfg := watchConfig(strings.TrimPrefix(srv.URL, "http://"))
			cfg.Consistency = mode
			rec := follow(t, cfg, "m/")
			rec.WaitFor(t, "snapshot", sourcetest.Holds(map[string]string{"a": "1"}))

			known.Store(false)
			if took := waitState(t, rec, true, 10*time.Second); took > 5*time.Second {
				t.Errorf("stale %v after the server lost its leader; want within 5 s", took)
			}
			if _, err := rec.State(); !strings.Contains(err.Error(), "knows no leader") {
				t.Errorf("status %v; want it to say the server knows no leader", err)
			}
			known.Store(true)
			waitState(t, rec, false, 10*time.Second)

			contact.Store(20_000) // ms: twenty seconds without the leader
			waitState(t, rec, true, 10*time.Second)
			if _, err := rec.State(); !strings.Contains(err.Error(), "max_stale") {
				t.Errorf("status %v; want it to name max_stale", err)
			}
			contact.Store(0)
			if took := waitState(t, rec, false, 10*time.Second); took > 1500*time.Millisecond {
				t.Errorf("current %v after the server heard from its leader again; want within a second", took)
			}
		})
	}
}

// TestStoreFaultRetriedAtProbePass: a query that the store fails (500)
// while the liveness probe passes — as for a second or two after a lost
// quorum comes back — tries again at the probe's next pass, not after a
// backoff grown to seconds: five failures in a row are over within 5 s
// (the backoff alone takes 15 s: 0.5, 1, 2, 4 and 8). A query refused
// for its own sake (403, a token refused) keeps to its backoff: at most
// 4 tries in 3 s, where the probe passes 30 times.
func TestStoreFaultRetriedAtProbePass(t *testing.T) {
	for _, tc := range []struct {
		code       int
		storeFault bool
	}{{http.StatusInternalServerError, true}, {http.StatusForbidden, false}} {
		t.Run(fmt.Sprint(tc.code), func(t *testing.T) {
			const failures = 5
			var lists atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("X-Consul-KnownLeader", "true")
				w.Header().Set("X-Consul-LastContact", "0")
				w.Header().Set("X-Consul-Index", "4")
				if !r.URL.Query().Has("recurse") {
					w.WriteHeader(http.StatusNotFound) // the probe's read: it passes
					return
				}
				if lists.Add(1) <= failures {
					http.Error(w, "rpc error making call: No cluster leader", tc.code)
					return
				}
				listOneKey(w, r)
			}))
			t.Cleanup(srv.Close)
			cfg := watchConfig(strings.TrimPrefix(srv.URL, "http://"))
			cfg.ProbeInterval = 100 * time.Millisecond
			start := time.Now()
			rec := follow(t, cfg, "m/")
			if !tc.storeFault {
				time.Sleep(3 * time.Second)
				if n := lists.Load(); n > 4 {
					t.Errorf("%d listings in 3 s, refused with %d while the probe passed; want at most 4 (the backoff's)", n, tc.code)
				}
				return
			}
			rec.WaitFor(t, "snapshot", sourcetest.Holds(map[string]string{"a": "1"}))
			if took := time.Since(start); took > 5*time.Second {
				t.Errorf("snapshot %v after %d failures of the store while the probe passed; want within 5 s", took.Round(time.Millisecond), failures)
			}
		})
	}
}

// listOneKey answers a fake agent's listing of m/ at index 4: m/a = 1,
// after a second's wait (or the request's end) for a blocking query on
// index 4, as an agent parks a query until its index moves.
func listOneKey(w http.ResponseWriter, r *http.Request) {
	if r.URL.Query().Get("index") == "4" {
		select {
		case <-r.Context().Done():
			return
		case <-time.After(time.Second):
		}
	}
	fmt.Fprint(w, `[{"Key":"m/a","Value":"MQ==","ModifyIndex":4}]`)
}
