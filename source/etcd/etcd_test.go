package etcd

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/source"
)

// waitTimeout bounds every wait for a snapshot; changes arrive in
// milliseconds, so this is only reached when something is broken.
const waitTimeout = 20 * time.Second

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

// recorder is a source.Publisher that keeps everything it is given.
type recorder struct {
	mu      sync.Mutex
	snaps   []source.Snapshot
	err     error
	errs    int
	changed chan struct{}
}

func newRecorder() *recorder { return &recorder{changed: make(chan struct{}, 1)} }

func (r *recorder) Publish(s source.Snapshot) {
	r.mu.Lock()
	r.snaps = append(r.snaps, s)
	r.err = nil
	r.mu.Unlock()
	r.wake()
}

func (r *recorder) Status(err error) {
	r.mu.Lock()
	r.err = err
	if err != nil {
		r.errs++
	}
	r.mu.Unlock()
	r.wake()
}

func (r *recorder) wake() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// waitFor waits until cond holds for the recorded snapshots and status.
func (r *recorder) waitFor(t *testing.T, what string, cond func(snaps []source.Snapshot, err error) bool) {
	t.Helper()
	deadline := time.After(waitTimeout)
	for {
		r.mu.Lock()
		ok := cond(r.snaps, r.err)
		r.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-r.changed:
		case <-deadline:
			r.mu.Lock()
			defer r.mu.Unlock()
			var last source.Snapshot
			if len(r.snaps) > 0 {
				last = r.snaps[len(r.snaps)-1]
			}
			t.Fatalf("timed out waiting for %s; %d snapshots, last %v, status %v", what, len(r.snaps), render(last), r.err)
		}
	}
}

// lastIs reports whether the last snapshot holds exactly want.
func lastIs(want map[string]string) func([]source.Snapshot, error) bool {
	return func(snaps []source.Snapshot, _ error) bool {
		return len(snaps) > 0 && render(snaps[len(snaps)-1]) == renderMap(want)
	}
}

func render(s source.Snapshot) string {
	m := map[string]string{}
	for k, v := range s.Entries {
		m[k] = string(v)
	}
	return renderMap(m)
}

func renderMap(m map[string]string) string {
	return fmt.Sprint(m)
}

// follow runs a Follow of prefix on a new Source until the test ends.
func follow(t *testing.T, cfg *Config, prefix string) *recorder {
	t.Helper()
	src, err := New("main", cfg, discard)
	if err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Follow(ctx, prefix, rec) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != context.Canceled {
				t.Errorf("Follow returned %v; want context.Canceled", err)
			}
		case <-time.After(waitTimeout):
			t.Errorf("Follow did not return after cancel")
		}
		src.Close()
	})
	return rec
}

func TestFollowPutUpdateDelete(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "/app/a", "1", "/app/dir/b", "2", "/other/x", "no")
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch}, "/app/")
	rec.waitFor(t, "initial snapshot", lastIs(map[string]string{"a": "1", "dir/b": "2"}))
	etcdtest.Put(t, cli, "/app/c", "3")
	rec.waitFor(t, "add", lastIs(map[string]string{"a": "1", "dir/b": "2", "c": "3"}))
	etcdtest.Put(t, cli, "/app/a", "one")
	rec.waitFor(t, "update", lastIs(map[string]string{"a": "one", "dir/b": "2", "c": "3"}))
	etcdtest.Put(t, cli, "/app/dir/b", etcdtest.Delete)
	rec.waitFor(t, "delete", lastIs(map[string]string{"a": "one", "c": "3"}))
	etcdtest.Put(t, cli, "/other/y", "ignored", "/app/a", "one") // no change under /app/
	etcdtest.Put(t, cli, "/app/a", etcdtest.Delete, "/app/c", etcdtest.Delete)
	rec.waitFor(t, "delete all", func(snaps []source.Snapshot, _ error) bool {
		last := snaps[len(snaps)-1]
		return len(last.Entries) == 0 && last.Missing
	})
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.snaps) != 5 {
		t.Errorf("got %d snapshots; want 5 (writes that change nothing under the prefix publish nothing)", len(rec.snaps))
	}
}

// TestTransactionIsOneSnapshot checks that the keys of one transaction are
// never split across snapshots.
func TestTransactionIsOneSnapshot(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "/tx/a", "0", "/tx/b", "0", "/tx/c", "0")
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch}, "/tx/")
	rec.waitFor(t, "initial snapshot", lastIs(map[string]string{"a": "0", "b": "0", "c": "0"}))
	const rounds = 200
	for i := 1; i <= rounds; i++ {
		v := fmt.Sprint(i)
		etcdtest.Put(t, cli, "/tx/a", v, "/tx/b", v, "/tx/c", v)
	}
	final := fmt.Sprint(rounds)
	rec.waitFor(t, "last transaction", lastIs(map[string]string{"a": final, "b": final, "c": final}))
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, s := range rec.snaps {
		a, b, c := string(s.Entries["a"]), string(s.Entries["b"]), string(s.Entries["c"])
		if a != b || b != c {
			t.Fatalf("snapshot at revision %s mixes transactions: a=%s b=%s c=%s", s.Revision, a, b, c)
		}
	}
}

// TestLargePrefix reads a prefix of 100,000 keys, more than one page.
func TestLargePrefix(t *testing.T) {
	if testing.Short() {
		t.Skip("100,000 keys take a while; run without -short")
	}
	srv, cli := etcdtest.Start(t)
	const n = 100_000
	const batch = 100 // below etcd's default --max-txn-ops of 128
	for i := 0; i < n; i += batch {
		kv := make([]string, 0, 2*batch)
		for j := i; j < i+batch; j++ {
			kv = append(kv, fmt.Sprintf("/big/key-%06d", j), fmt.Sprint(j))
		}
		etcdtest.Put(t, cli, kv...)
	}
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch}, "/big/")
	rec.waitFor(t, "100,000 keys", func(snaps []source.Snapshot, _ error) bool {
		return len(snaps) > 0 && len(snaps[len(snaps)-1].Entries) == n
	})
	etcdtest.Put(t, cli, "/big/key-000000", "changed")
	rec.waitFor(t, "a change after the large read", func(snaps []source.Snapshot, _ error) bool {
		last := snaps[len(snaps)-1]
		return string(last.Entries["key-000000"]) == "changed" && string(last.Entries["key-099999"]) == "99999" && len(last.Entries) == n
	})
}

// TestCompactionRereads compacts the revision the watch would start from:
// the follower must re-read the prefix, and keys deleted meanwhile must be
// gone from the next snapshot.
func TestCompactionRereads(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "/c/keep", "1", "/c/gone", "2")
	var once sync.Once
	testHookAfterList = func() {
		once.Do(func() {
			etcdtest.Put(t, cli, "/c/gone", etcdtest.Delete, "/c/new", "3")
			resp, err := cli.Get(context.Background(), "/c/keep")
			if err != nil {
				t.Error(err)
				return
			}
			if _, err := cli.Compact(context.Background(), resp.Header.Revision); err != nil {
				t.Error(err)
			}
		})
	}
	t.Cleanup(func() { testHookAfterList = nil })
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch}, "/c/")
	rec.waitFor(t, "snapshot after compaction", lastIs(map[string]string{"keep": "1", "new": "3"}))
	etcdtest.Put(t, cli, "/c/later", "4")
	rec.waitFor(t, "watch resumed after compaction", lastIs(map[string]string{"keep": "1", "new": "3", "later": "4"}))
}

// TestOutageKeepsLastSnapshot stops etcd while a prefix is followed: the
// follower reports the source unreachable, keeps going, and delivers writes
// made after etcd is back.
func TestOutageKeepsLastSnapshot(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "/o/a", "1")
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch, DialTimeout: time.Second}, "/o/")
	rec.waitFor(t, "initial snapshot", lastIs(map[string]string{"a": "1"}))
	srv.Stop() // takes etcd's request timeout (7 s) to end the open watch
	rec.waitFor(t, "stale status", func(_ []source.Snapshot, err error) bool { return err != nil })
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, "healthy status", func(_ []source.Snapshot, err error) bool { return err == nil })
	etcdtest.Put(t, cli, "/o/a", "2")
	rec.waitFor(t, "write after restart", lastIs(map[string]string{"a": "2"}))
}

// TestStartsWhileEtcdIsDown follows a prefix of an etcd that is not running
// yet: the follower reports it unreachable and reads it once it runs.
func TestStartsWhileEtcdIsDown(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "/d/a", "1")
	srv.Stop()
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch, DialTimeout: time.Second}, "/d/")
	rec.waitFor(t, "stale status", func(_ []source.Snapshot, err error) bool { return err != nil })
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	rec.waitFor(t, "snapshot once etcd runs", lastIs(map[string]string{"a": "1"}))
}

func TestPoll(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "/p/a", "1")
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Poll, PollInterval: 50 * time.Millisecond}, "/p/")
	rec.waitFor(t, "initial snapshot", lastIs(map[string]string{"a": "1"}))
	etcdtest.Put(t, cli, "/p/a", "2", "/p/b", "3")
	rec.waitFor(t, "polled change", lastIs(map[string]string{"a": "2", "b": "3"}))
	etcdtest.Put(t, cli, "/p/a", etcdtest.Delete)
	rec.waitFor(t, "polled delete", lastIs(map[string]string{"b": "3"}))
	rec.mu.Lock()
	n := len(rec.snaps)
	rec.mu.Unlock()
	etcdtest.Put(t, cli, "/elsewhere", "x") // moves the revision, changes nothing under /p/
	time.Sleep(300 * time.Millisecond)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if len(rec.snaps) != n {
		t.Errorf("polls without a change published %d more snapshots", len(rec.snaps)-n)
	}
}

func TestEmptyPrefixIsEveryKey(t *testing.T) {
	srv, cli := etcdtest.Start(t)
	etcdtest.Put(t, cli, "a", "1", "/b/c", "2")
	rec := follow(t, &Config{Endpoints: []string{srv.Endpoint()}, ChangeDetection: Watch}, "")
	rec.waitFor(t, "every key", lastIs(map[string]string{"a": "1", "/b/c": "2"}))
	etcdtest.Put(t, cli, "z", "3")
	rec.waitFor(t, "watch of every key", lastIs(map[string]string{"a": "1", "/b/c": "2", "z": "3"}))
}

func TestDecode(t *testing.T) {
	dir := t.TempDir()
	kinds := map[string]config.SourceDecoder{"etcd": Decode}
	tests := []struct {
		name    string
		toml    string
		want    *Config
		wantErr string
	}{
		{name: "defaults", toml: `type = "etcd"`, want: &Config{
			Endpoints: []string{DefaultEndpoint}, DialTimeout: DefaultDialTimeout, ChangeDetection: Watch, PollInterval: DefaultPollInterval,
		}},
		{name: "poll", toml: "type = \"etcd\"\nendpoints = [\"https://10.0.0.1:2379\", \"unix:///run/etcd.sock\"]\nchange_detection = \"poll\"\npoll_interval = \"5s\"\ndial_timeout = \"2s\"", want: &Config{
			Endpoints: []string{"https://10.0.0.1:2379", "unix:///run/etcd.sock"}, DialTimeout: 2 * time.Second, ChangeDetection: Poll, PollInterval: 5 * time.Second,
		}},
		{name: "bad endpoint", toml: "type = \"etcd\"\nendpoints = [\"127.0.0.1:2379\"]", wantErr: `s.toml:3: sources.main.endpoints: "127.0.0.1:2379": want a URL with scheme`},
		{name: "no endpoints", toml: "type = \"etcd\"\nendpoints = []", wantErr: `endpoints: needs at least one endpoint`},
		{name: "user without password", toml: "type = \"etcd\"\nusername = \"root\"", wantErr: `username and password_file go together`},
		{name: "missing password file", toml: "type = \"etcd\"\nusername = \"root\"\npassword_file = \"" + dir + "/nope\"", wantErr: `password_file: open ` + dir + `/nope: no such file or directory`},
		{name: "bad change detection", toml: "type = \"etcd\"\nchange_detection = \"push\"", wantErr: `change_detection: "push" is not one of watch, poll`},
		{name: "cert without key", toml: "type = \"etcd\"\ntls = { cert_file = \"/dev/null\" }", wantErr: `tls: cert_file and key_file go together`},
		{name: "unknown key", toml: "type = \"etcd\"\nendpoint = \"x\"", wantErr: `sources.main.endpoint: unknown key (did you mean "endpoints"?)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := config.Parse("s.toml", []byte("[sources.main]\n"+tt.toml+"\n"), kinds)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v; want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := cfg.Sources["main"].Settings.(*Config)
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("got %+v; want %+v", got, tt.want)
			}
		})
	}
}
