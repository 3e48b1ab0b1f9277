package consul

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/source"
)

func follow(t *testing.T, cfg *Config, prefix string) *sourcetest.Recorder {
	t.Helper()
	src, err := New("main", cfg, sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() }) // after the Follow has ended
	return sourcetest.Follow(t, src, prefix)
}

func watchConfig(addr string) *Config {
	return &Config{Address: "http://" + addr, Consistency: ConsistencyDefault, Wait: DefaultWait, ChangeDetection: Watch, PollInterval: DefaultPollInterval,
		ProbeInterval: DefaultProbeInterval, MaxStale: DefaultMaxStale}
}

func TestFollow(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	consultest.Txn(t, client, "app/a", "1", "app/dir/b", "2", "other/x", "no")
	rec := follow(t, watchConfig(agent.Addr()), "app/")
	rec.WaitFor(t, "initial snapshot", sourcetest.Holds(map[string]string{"a": "1", "dir/b": "2"}))
	consultest.Txn(t, client, "app/a", "one", "app/c", "3")
	rec.WaitFor(t, "update", sourcetest.Holds(map[string]string{"a": "one", "dir/b": "2", "c": "3"}))
	consultest.Txn(t, client, "app/dir/b", consultest.Delete)
	rec.WaitFor(t, "delete", sourcetest.Holds(map[string]string{"a": "one", "c": "3"}))
	consultest.Txn(t, client, "app/a", consultest.Delete, "app/c", consultest.Delete)
	rec.WaitFor(t, "prefix gone", sourcetest.Missing)
}

// TestTransactionIsOneSnapshot checks that the keys of one Consul
// transaction are never split across snapshots.
func TestTransactionIsOneSnapshot(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	consultest.Txn(t, client, "tx/a", "0", "tx/b", "0")
	rec := follow(t, watchConfig(agent.Addr()), "tx/")
	rec.WaitFor(t, "initial snapshot", sourcetest.Holds(map[string]string{"a": "0", "b": "0"}))
	for i := 1; i <= 100; i++ {
		consultest.Txn(t, client, "tx/a", fmt.Sprint(i), "tx/b", fmt.Sprint(i))
	}
	rec.WaitFor(t, "last transaction", sourcetest.Holds(map[string]string{"a": "100", "b": "100"}))
	snaps, _ := rec.State()
	for _, s := range snaps {
		if string(s.Entries.ValueOf("a")) != string(s.Entries.ValueOf("b")) {
			t.Fatalf("snapshot at index %s mixes transactions: %q %q", s.Revision, s.Entries.ValueOf("a"), s.Entries.ValueOf("b"))
		}
	}
}

// TestAgentRestartResetsIndex restarts a -dev agent, which comes back
// empty with small indexes: writes made after the restart must be found
// at once, not after the blocking query's wait.
func TestAgentRestartResetsIndex(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	// Push the index well above what the new agent will start from.
	for i := range 30 {
		consultest.Txn(t, client, "r/a", fmt.Sprint(i))
	}
	rec := follow(t, watchConfig(agent.Addr()), "r/")
	rec.WaitFor(t, "initial snapshot", sourcetest.Holds(map[string]string{"a": "29"}))
	agent.Stop()
	rec.WaitFor(t, "stale status", sourcetest.Failing)
	if err := agent.Restart(); err != nil {
		t.Fatal(err)
	}
	consultest.Txn(t, client, "r/a", "after restart")
	rec.WaitFor(t, "write after restart", sourcetest.Holds(map[string]string{"a": "after restart"}))
}

func TestPoll(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	consultest.Txn(t, client, "p/a", "1")
	cfg := watchConfig(agent.Addr())
	cfg.ChangeDetection, cfg.PollInterval = Poll, 50*time.Millisecond
	rec := follow(t, cfg, "p/")
	rec.WaitFor(t, "initial snapshot", sourcetest.Holds(map[string]string{"a": "1"}))
	consultest.Txn(t, client, "p/a", "2")
	rec.WaitFor(t, "polled change", sourcetest.Holds(map[string]string{"a": "2"}))
}

// TestMisbehavingServerCannotMakeItSpin serves blocking queries that return
// at once without a change, forever: the token bucket must hold kvmount to
// a few queries, each confirmed by one non-blocking read. (A fake beside
// the real-agent tests: no real agent misbehaves on request.)
func TestMisbehavingServerCannotMakeItSpin(t *testing.T) {
	var queries atomic.Int64
	srv := httptest.NewServer(fakeAgent(func(w http.ResponseWriter, r *http.Request) {
		queries.Add(1)
		w.Header().Set("X-Consul-Index", "7")
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `[{"Key":"m/a","Value":"MQ==","ModifyIndex":7}]`)
	}))
	t.Cleanup(srv.Close) // after the Follow has ended, which a deferred Close would wait for
	rec := follow(t, watchConfig(strings.TrimPrefix(srv.URL, "http://")), "m/")
	rec.WaitFor(t, "snapshot", sourcetest.Holds(map[string]string{"a": "1"}))
	time.Sleep(time.Second) // the span over which queries are counted
	if n := queries.Load(); n > 2*(idleBurst+2) {
		t.Errorf("%d queries in about a second; the rate limit allows %d, each confirmed once", n, 2*(idleBurst+2))
	}
}

// TestFailedQueryResetsTheIndex: after a failed query the next one is a
// fresh read without an index (an agent restarted without its data may
// have reset every index), never a blocking query on the old index.
func TestFailedQueryResetsTheIndex(t *testing.T) {
	var mu sync.Mutex
	var indexes []string
	srv := httptest.NewServer(fakeAgent(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		indexes = append(indexes, r.URL.Query().Get("index"))
		n := len(indexes)
		mu.Unlock()
		if n == 2 {
			http.Error(w, "agent restarting", http.StatusInternalServerError)
			return
		}
		w.Header().Set("X-Consul-Index", "7")
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `[{"Key":"m/a","Value":"MQ==","ModifyIndex":7}]`)
		if n > 2 && r.URL.Query().Get("index") != "" {
			<-r.Context().Done() // a real blocking query
		}
	}))
	t.Cleanup(srv.Close) // after the Follow has ended, which a deferred Close would wait for
	rec := follow(t, watchConfig(strings.TrimPrefix(srv.URL, "http://")), "m/")
	rec.WaitFor(t, "snapshot", sourcetest.Holds(map[string]string{"a": "1"}))
	rec.WaitFor(t, "the failure", sourcetest.Failing)
	rec.WaitFor(t, "recovery", sourcetest.Healthy)
	mu.Lock()
	defer mu.Unlock()
	if len(indexes) < 3 || indexes[0] != "" || indexes[1] != "7" || indexes[2] != "" {
		t.Errorf("query indexes %q; want a fresh read, a blocking query on 7, then (after the failure) a fresh read", indexes)
	}
}

func TestNextIndex(t *testing.T) {
	tests := []struct{ index, got, want uint64 }{
		{0, 0, 1},    // never block on 0
		{0, 42, 42},  // first read
		{42, 42, 42}, // no change: block again
		{42, 50, 50}, // change
		{42, 7, 0},   // went backwards: fresh read
		{42, 0, 0},   // went to zero: fresh read
	}
	for _, tt := range tests {
		if got := nextIndex(tt.index, tt.got); got != tt.want {
			t.Errorf("nextIndex(%d, %d) = %d; want %d", tt.index, tt.got, got, tt.want)
		}
	}
}

func TestDecode(t *testing.T) {
	dir := t.TempDir()
	kinds := map[string]config.SourceDecoder{"consul": Decode}
	tests := []struct {
		name    string
		toml    string
		want    string
		wantErr string
	}{
		{name: "defaults", toml: `type = "consul"`, want: "http://127.0.0.1:8500 default 5m0s watch 30s"},
		{name: "all", toml: "type = \"consul\"\naddress = \"https://consul.internal:8501\"\ndatacenter = \"dc2\"\nconsistency = \"stale\"\nwait = \"1m\"\nchange_detection = \"poll\"\npoll_interval = \"10s\"",
			want: "https://consul.internal:8501 stale 1m0s poll 10s"},
		{name: "no scheme", toml: "type = \"consul\"\naddress = \"127.0.0.1:8500\"", wantErr: `c.toml:3: sources.main.address: "127.0.0.1:8500": want a URL with scheme http or https`},
		{name: "wait too long", toml: "type = \"consul\"\nwait = \"11m\"", wantErr: `wait: 11m0s is longer than Consul's maximum of 10m0s`},
		{name: "bad consistency", toml: "type = \"consul\"\nconsistency = \"eventual\"", wantErr: `consistency: "eventual" is not one of default, stale, consistent`},
		{name: "missing token file", toml: "type = \"consul\"\ntoken_file = \"" + dir + "/nope\"", wantErr: `token_file: open ` + dir + `/nope`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := config.Parse("c.toml", []byte("[sources.main]\n"+tt.toml+"\n"), kinds)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v; want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			c := cfg.Sources["main"].Settings.(*Config)
			if got := fmt.Sprintf("%s %s %v %s %v", c.Address, c.Consistency, c.Wait, c.ChangeDetection, c.PollInterval); got != tt.want {
				t.Errorf("got %s; want %s", got, tt.want)
			}
		})
	}
}

// emptyAgent is an httptest server that answers like an agent with no
// keys (404 at index 3) and hands each request to record first. It closes
// after the test's Follows have ended, which a deferred Close would wait
// for.
func emptyAgent(t *testing.T, record func(r *http.Request)) *httptest.Server {
	srv := httptest.NewServer(fakeAgent(func(w http.ResponseWriter, r *http.Request) {
		record(r)
		w.Header().Set("X-Consul-Index", "3")
		w.WriteHeader(http.StatusNotFound)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// fakeAgent wraps the handler of a fake agent's listings (?recurse): it
// answers the liveness probe itself (a key read, 404 from a server that
// knows its leader), and says of every answer what a healthy cluster's
// server says (X-Consul-KnownLeader: true, X-Consul-LastContact: 0).
func fakeAgent(list http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Consul-KnownLeader", "true")
		w.Header().Set("X-Consul-LastContact", "0")
		if !r.URL.Query().Has("recurse") {
			w.Header().Set("X-Consul-Index", "1")
			w.WriteHeader(http.StatusNotFound)
			return
		}
		list(w, r)
	})
}

func TestTokenIsSentAndNeverPrinted(t *testing.T) {
	var got atomic.Value
	srv := emptyAgent(t, func(r *http.Request) { got.Store(r.Header.Get("X-Consul-Token")) })
	tokenFile := t.TempDir() + "/token"
	if err := writeFile(tokenFile, "s3cr3t-token\n"); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse("c.toml", []byte("[sources.main]\ntype = \"consul\"\naddress = \""+srv.URL+"\"\ntoken_file = \""+tokenFile+"\"\n"), map[string]config.SourceDecoder{"consul": Decode})
	if err != nil {
		t.Fatal(err)
	}
	c := cfg.Sources["main"].Settings.(*Config)
	if s := fmt.Sprintf("%v %+v %#v", c, c, c); strings.Contains(s, "s3cr3t") {
		t.Errorf("the token is printed: %s", s)
	}
	rec := follow(t, c, "x/")
	rec.WaitFor(t, "missing prefix", sourcetest.Missing)
	if got.Load() != "s3cr3t-token" {
		t.Errorf("X-Consul-Token = %q; want the token from the file", got.Load())
	}
}

// TestEnvironmentIsIgnored: CONSUL_* variables the Consul API client reads
// change nothing kvmount sends.
func TestEnvironmentIsIgnored(t *testing.T) {
	type seen struct{ token, query, auth string }
	var got atomic.Value
	srv := emptyAgent(t, func(r *http.Request) {
		got.Store(seen{r.Header.Get("X-Consul-Token"), r.URL.RawQuery, r.Header.Get("Authorization")})
	})
	envToken := t.TempDir() + "/env-token"
	if err := writeFile(envToken, "from-env-file\n"); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CONSUL_HTTP_TOKEN", "from-env")
	t.Setenv("CONSUL_HTTP_TOKEN_FILE", envToken)
	t.Setenv("CONSUL_NAMESPACE", "team-a")
	t.Setenv("CONSUL_PARTITION", "part-b")
	t.Setenv("CONSUL_HTTP_AUTH", "user:pass")
	c := watchConfig(strings.TrimPrefix(srv.URL, "http://"))
	rec := follow(t, c, "x/")
	rec.WaitFor(t, "missing prefix", sourcetest.Missing)
	s := got.Load().(seen)
	if s.token != "" || s.auth != "" || strings.Contains(s.query, "ns=") || strings.Contains(s.query, "partition=") {
		t.Errorf("request carried token %q, Authorization %q, query %q; want none of the environment's", s.token, s.auth, s.query)
	}
}

// TestCompressionOnlyOverANetwork: a loopback agent's responses are read
// uncompressed (kvmount does not ask for gzip), a remote agent's stay
// compressed.
func TestCompressionOnlyOverANetwork(t *testing.T) {
	var got atomic.Value
	srv := emptyAgent(t, func(r *http.Request) { got.Store(r.Header.Get("Accept-Encoding")) })
	rec := follow(t, watchConfig(strings.TrimPrefix(srv.URL, "http://")), "x/")
	rec.WaitFor(t, "missing prefix", sourcetest.Missing)
	if ae := got.Load().(string); strings.Contains(ae, "gzip") {
		t.Errorf("Accept-Encoding = %q to an agent on %s; want no gzip", ae, srv.URL)
	}
	for _, tt := range []struct {
		address  string
		compress bool
	}{
		{"http://127.0.0.1:8500", false},
		{"http://127.3.2.1:8500", false},
		{"http://localhost:8500", false},
		{"http://[::1]:8500", false},
		{"https://consul.example:8501", true},
		{"http://10.0.0.7:8500", true},
	} {
		cfg := watchConfig("")
		cfg.Address = tt.address
		src, err := New("main", cfg, sourcetest.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if compress := !src.transport.DisableCompression; compress != tt.compress {
			t.Errorf("%s: compressed responses = %v; want %v", tt.address, compress, tt.compress)
		}
	}
}

func writeFile(name, data string) error { return os.WriteFile(name, []byte(data), 0o600) }

// agentConnections counts this process's established TCP connections to
// port: /proc/self/net/tcp lists the namespace's sockets, /proc/self/fd
// says which are ours.
func agentConnections(t *testing.T, port string) int {
	t.Helper()
	ours := map[string]bool{}
	fds, _ := os.ReadDir("/proc/self/fd")
	for _, fd := range fds {
		if target, err := os.Readlink("/proc/self/fd/" + fd.Name()); err == nil && strings.HasPrefix(target, "socket:[") {
			ours[strings.TrimSuffix(strings.TrimPrefix(target, "socket:["), "]")] = true
		}
	}
	p, _ := strconv.Atoi(port)
	hexPort := fmt.Sprintf(":%04X", p)
	n := 0
	for _, table := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		data, err := os.ReadFile(table)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(data), "\n")[1:] {
			f := strings.Fields(line)
			// sl local remote st ... inode
			if len(f) > 9 && strings.HasSuffix(f[2], hexPort) && f[3] == "01" && ours[f[9]] {
				n++
			}
		}
	}
	return n
}

// TestManyPrefixesFewConnections follows 300 prefixes of one default agent
// (which refuses more than 200 connections per client): every prefix gets
// its snapshot, a write to the last one arrives, and the source holds a
// connection per group (three: many/p0, many/p1, many/p2), not one per
// prefix.
func TestManyPrefixesFewConnections(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	const n = 300
	var kv []string
	for i := range n {
		kv = append(kv, fmt.Sprintf("many/p%03d/key", i), fmt.Sprint(i))
	}
	consultest.Txn(t, client, kv...)
	src, err := New("main", watchConfig(agent.Addr()), sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	recs := make([]*sourcetest.Recorder, n)
	for i := range n {
		recs[i] = sourcetest.Follow(t, src, fmt.Sprintf("many/p%03d/", i))
	}
	for i, rec := range recs {
		rec.WaitFor(t, fmt.Sprintf("prefix %d", i), sourcetest.Holds(map[string]string{"key": fmt.Sprint(i)}))
	}
	consultest.Txn(t, client, fmt.Sprintf("many/p%03d/key", n-1), "last", fmt.Sprintf("many/p%03d/new", n-1), "x")
	recs[n-1].WaitFor(t, "the write to the last prefix", sourcetest.Holds(map[string]string{"key": "last", "new": "x"}))
	// The others saw nothing new: one snapshot each.
	if snaps, _ := recs[0].State(); len(snaps) != 1 {
		t.Errorf("prefix 0 got %d snapshots; want 1 (the write was elsewhere)", len(snaps))
	}
	_, port, _ := strings.Cut(agent.Addr(), ":")
	if c := agentConnections(t, port); c > 8 {
		t.Errorf("%d connections to the agent for %d prefixes; want at most 8", c, n)
	}
	t.Logf("%d prefixes, %d connections to the agent (the source's and the test's client)", n, agentConnections(t, port))
}

// TestPrefixesWithNothingInCommon: "a/" and "b/" share no prefix; each
// has a query of its own (not one on all of KV), and keys elsewhere are
// not theirs.
func TestPrefixesWithNothingInCommon(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	consultest.Txn(t, client, "a/x", "1", "b/y", "2", "c/z", "3")
	src, err := New("main", watchConfig(agent.Addr()), sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	a, b := sourcetest.Follow(t, src, "a/"), sourcetest.Follow(t, src, "b/")
	a.WaitFor(t, "a", sourcetest.Holds(map[string]string{"x": "1"}))
	b.WaitFor(t, "b", sourcetest.Holds(map[string]string{"y": "2"}))
	waitGroups(t, src, "a/", "b/")
	consultest.Txn(t, client, "b/y", "two", "a/x", consultest.Delete)
	b.WaitFor(t, "b updated", sourcetest.Holds(map[string]string{"y": "two"}))
	a.WaitFor(t, "a emptied", sourcetest.Missing)
	// A prefix added later gets a query of its own and is served at once;
	// when it is no longer followed, its query goes.
	ctx, cancel := context.WithCancel(context.Background())
	c := sourcetest.NewRecorder()
	done := make(chan error, 1)
	go func() { done <- src.Follow(ctx, "c/", c) }()
	c.WaitFor(t, "c", sourcetest.Holds(map[string]string{"z": "3"}))
	waitGroups(t, src, "a/", "b/", "c/")
	cancel()
	<-done
	waitGroups(t, src, "a/", "b/")
}

// TestNestedPrefixes: prefixes inside one another, and one that is a
// prefix of another only as a string ("app/db/" and "app/dbx/"), each get
// exactly their keys from their group's response, and one that did not
// change publishes nothing.
func TestNestedPrefixes(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	consultest.Txn(t, client, "app/a", "1", "app/db/x", "2", "app/dbx/y", "3", "app/web/z", "4", "apps/q", "5")
	src, err := New("main", watchConfig(agent.Addr()), sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	want := map[string]map[string]string{
		"app/":     {"a": "1", "db/x": "2", "dbx/y": "3", "web/z": "4"},
		"app/db/":  {"x": "2"},
		"app/dbx/": {"y": "3"},
		"app/web/": {"z": "4"},
		"apps/":    {"q": "5"},
	}
	recs := map[string]*sourcetest.Recorder{}
	for _, prefix := range []string{"app/web/", "apps/", "app/", "app/dbx/", "app/db/"} {
		recs[prefix] = sourcetest.Follow(t, src, prefix)
	}
	for prefix, rec := range recs {
		rec.WaitFor(t, prefix, sourcetest.Holds(want[prefix]))
	}
	waitGroups(t, src, "app/", "apps/")
	consultest.Txn(t, client, "app/db/x", "two", "app/web/z", consultest.Delete)
	recs["app/"].WaitFor(t, "app/ updated", sourcetest.Holds(map[string]string{"a": "1", "db/x": "two", "dbx/y": "3"}))
	recs["app/db/"].WaitFor(t, "app/db/ updated", sourcetest.Holds(map[string]string{"x": "two"}))
	recs["app/web/"].WaitFor(t, "app/web/ emptied", sourcetest.Missing)
	for _, prefix := range []string{"app/dbx/", "apps/"} {
		if snaps, _ := recs[prefix].State(); len(snaps) != 1 {
			t.Errorf("%s: %d snapshots; want 1, its keys never changed", prefix, len(snaps))
		}
	}
}

// waitGroups waits until the source's queries read want.
func waitGroups(t *testing.T, src *Source, want ...string) {
	t.Helper()
	var groups []string
	for deadline := time.Now().Add(sourcetest.Timeout); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		src.mu.Lock()
		groups = slices.Clone(src.groups)
		src.mu.Unlock()
		if slices.Equal(groups, want) {
			return
		}
	}
	t.Fatalf("queries read %q; want %q", groups, want)
}

// TestPartition: which prefixes the queries read for a set of followed
// prefixes, with at most maxQueries of them.
func TestPartition(t *testing.T) {
	many := func(format string, n int) []string {
		var out []string
		for i := range n {
			out = append(out, fmt.Sprintf(format, i))
		}
		return out
	}
	for _, c := range []struct {
		name     string
		prefixes []string
		want     []string
	}{
		{"none", nil, nil},
		{"one", []string{"app/"}, []string{"app/"}},
		{"duplicates", []string{"app/", "app/"}, []string{"app/"}},
		{"nothing in common", []string{"a/", "b/"}, []string{"a/", "b/"}},
		{"a VM of a fleet", []string{"fleet/shared/", "fleet/vm0042/"}, []string{"fleet/shared/", "fleet/vm0042/"}},
		{"one inside another", []string{"app/", "app/db/", "app/web/"}, []string{"app/"}},
		{"nested, beside another", []string{"app/", "app/db/", "other/"}, []string{"app/", "other/"}},
		{"the whole store", []string{"", "a/"}, []string{""}},
		{"ten branches stay one query", many("p%04d/", 1000), []string{"p0"}},
		{"three branches", many("p%03d/", 300), []string{"p0", "p1", "p2"}},
		// a/ would split into three: five queries with b/1/ and c/.
		{"within the budget", []string{"a/1/", "a/2/", "a/3/", "b/1/", "c/"}, []string{"a/", "b/1/", "c/"}},
		{"split twice", []string{"x/a/1/", "x/a/2/", "x/b/"}, []string{"x/a/1/", "x/a/2/", "x/b/"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := source.Partition(c.prefixes, maxQueries)
			if !slices.Equal(got, c.want) {
				t.Errorf("Partition(%q) = %q; want %q", c.prefixes, got, c.want)
			}
			for _, p := range c.prefixes {
				n := 0
				for _, g := range got {
					if strings.HasPrefix(p, g) {
						n++
					}
				}
				if n != 1 {
					t.Errorf("%q is covered by %d queries; want 1", p, n)
				}
			}
			if len(got) > maxQueries {
				t.Errorf("%d queries; want at most %d", len(got), maxQueries)
			}
		})
	}
}

// TestResponseBoundedByLimits is the second review's ninth finding for
// Consul: a follower whose mount takes at most 5 keys and 1 MiB bounds the
// response its group's query reads (1 MiB base64-encoded, room for 5 keys'
// JSON and 64 KiB): 60 values of 300 KB (24 MB of JSON) fail the read with
// source.ErrOverLimits — never held — and a prefix within the bounds reads
// as before.
func TestResponseBoundedByLimits(t *testing.T) {
	agent := consultest.Start(t)
	client := agent.Client()
	big := strings.Repeat("x", 300_000) // a transaction carries at most 512 KiB, base64-encoded
	for i := range 60 {
		consultest.Txn(t, client, fmt.Sprintf("many/k%02d", i), big)
	}
	src, err := New("main", watchConfig(agent.Addr()), sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	lim := source.Limits{MaxKeys: 5, MaxValueSize: 1 << 20, MaxBytes: 1 << 20}
	many := sourcetest.FollowLimited(t, src, "many/", lim)
	many.WaitFor(t, "the refusal", func(_ []source.Snapshot, err error) bool { return errors.Is(err, source.ErrOverLimits) })
	if snaps, _ := many.State(); len(snaps) != 0 {
		t.Errorf("%d snapshots of a prefix over the limits; want none", len(snaps))
	}

	consultest.Txn(t, client, "few/a", "1", "few/b", "2")
	src2, err := New("main", watchConfig(agent.Addr()), sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src2.Close() })
	few := sourcetest.FollowLimited(t, src2, "few/", lim)
	few.WaitFor(t, "a prefix within the limits", sourcetest.Holds(map[string]string{"a": "1", "b": "2"}))
}
