package vault

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/faultproxy"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/vaulttest"
	"github.com/kvmount/kvmount/source"
)

// recordingProxy is a reverse proxy in front of a real Vault server that
// records each request's method, path and headers, for tests that count
// what the source asks.
type recordingProxy struct {
	srv *httptest.Server
	mu  sync.Mutex
	log []recorded
}

type recorded struct {
	method, path string
	header       http.Header
}

func newRecordingProxy(t *testing.T, backend string) *recordingProxy {
	t.Helper()
	u, err := url.Parse(backend)
	if err != nil {
		t.Fatal(err)
	}
	p := &recordingProxy{}
	rp := httputil.NewSingleHostReverseProxy(u)
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		method := r.Method
		if r.URL.Query().Get("list") == "true" {
			method = "LIST"
		}
		p.mu.Lock()
		p.log = append(p.log, recorded{method: method, path: r.URL.Path, header: r.Header.Clone()})
		p.mu.Unlock()
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

// take returns the requests recorded since the last take.
func (p *recordingProxy) take() []recorded {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.log
	p.log = nil
	return out
}

// count returns how many of reqs have method and a path starting with
// prefix.
func count(reqs []recorded, method, prefix string) int {
	n := 0
	for _, r := range reqs {
		if r.method == method && strings.HasPrefix(r.path, prefix) {
			n++
		}
	}
	return n
}

// waitPolls waits until rec has seen n more statuses (a poll reports one
// each time) than before.
func waitPolls(t *testing.T, rec *sourcetest.Recorder, n int) {
	t.Helper()
	start := rec.Statuses()
	deadline := time.Now().Add(sourcetest.Timeout)
	for rec.Statuses() < start+n {
		if time.Now().After(deadline) {
			t.Fatalf("fewer than %d polls in %v", n, sourcetest.Timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestThousandSecrets: 1,000 secrets under one prefix; an idle poll costs
// their metadata — a listing and one metadata read each — and no data
// read; a change reads the one secret that changed.
func TestThousandSecrets(t *testing.T) {
	srv := vaulttest.Start(t)
	want := map[string]string{}
	c := srv.Client(t)
	var wg sync.WaitGroup
	errs := make(chan error, 1000)
	sem := make(chan struct{}, 16)
	for i := range 1000 {
		name := fmt.Sprintf("s%04d", i)
		want[name+"/v"] = fmt.Sprint(i)
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if _, err := c.KVv2("secret").Put(context.Background(), "many/"+name, map[string]any{"v": fmt.Sprint(i)}); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	proxy := newRecordingProxy(t, srv.URL())
	tok := writeFile(t, t.TempDir(), "token", vaulttest.RootToken)
	src, _ := openTest(t, fmt.Sprintf("address = %q\ntoken_file = %q\npoll_interval = \"200ms\"\n", proxy.srv.URL, tok))
	rec := sourcetest.FollowLimited(t, src, "secret/many/", source.Limits{MaxKeys: 2000})
	rec.WaitFor(t, "1,000 secrets", sourcetest.Holds(want))
	waitPolls(t, rec, 1)
	proxy.take()
	waitPolls(t, rec, 2)
	idle := proxy.take()
	polls := count(idle, "LIST", "/v1/secret/metadata/many")
	if polls < 2 {
		for _, r := range idle[:min(5, len(idle))] {
			t.Logf("%s %s", r.method, r.path)
		}
		t.Fatalf("%d listings in two polls", polls)
	}
	if n := count(idle, "GET", "/v1/secret/data/"); n != 0 {
		t.Errorf("idle polls read data %d times; want only metadata", n)
	}
	if n, most := count(idle, "GET", "/v1/secret/metadata/many/"), (polls+1)*1000; n < (polls-1)*1000 || n > most {
		t.Errorf("%d metadata reads in %d polls; want 1,000 a poll", n, polls)
	}
	srv.Put(t, "secret", "many/s0042", map[string]any{"v": "changed"})
	want["s0042/v"] = "changed"
	rec.WaitFor(t, "the change", sourcetest.Holds(want))
	if n := count(proxy.take(), "GET", "/v1/secret/data/"); n != 1 {
		t.Errorf("the change made %d data reads; want 1", n)
	}
}

// TestKVv1 follows a KV v1 engine: every secret read on each poll.
func TestKVv1(t *testing.T) {
	srv := vaulttest.Start(t)
	srv.Write(t, "sys/mounts/kv1", map[string]any{"type": "kv", "options": map[string]any{"version": "1"}})
	srv.Write(t, "kv1/app/db", map[string]any{"user": "ada", "n": 3})
	src, _ := tokenSource(t, srv, "")
	rec := sourcetest.Follow(t, src, "kv1/app/")
	rec.WaitFor(t, "the secret", sourcetest.Holds(map[string]string{"db/user": "ada", "db/n": "3"}))
	srv.Write(t, "kv1/app/db", map[string]any{"user": "bob"})
	srv.Write(t, "kv1/app/x/y", map[string]any{"z": "1"})
	rec.WaitFor(t, "the change", sourcetest.Holds(map[string]string{"db/user": "bob", "x/y/z": "1"}))
	last := sourcetest.Last(mustSnaps(rec))
	if s := last.Secrets["kv1/app/db"]; s == nil || s.Data["user"] != "bob" {
		t.Errorf("template data %v", last.Secrets)
	}
	if _, err := srv.Client(t).Logical().Delete("kv1/app/db"); err != nil {
		t.Fatal(err)
	}
	rec.WaitFor(t, "the delete", sourcetest.Holds(map[string]string{"x/y/z": "1"}))
}

// TestOutageKeepsLastSnapshot: with the server unreachable the source
// reports the failure and publishes nothing — the mounts keep their last
// content — and resumes when it is back.
func TestOutageKeepsLastSnapshot(t *testing.T) {
	srv := vaulttest.Start(t)
	srv.Put(t, "secret", "app/db", map[string]any{"password": "before"})
	proxy, err := faultproxy.Start(srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	tok := writeFile(t, t.TempDir(), "token", vaulttest.RootToken)
	src, logs := openTest(t, fmt.Sprintf("address = \"http://%s\"\ntoken_file = %q\npoll_interval = \"100ms\"\n", proxy.Addr(), tok))
	rec := sourcetest.Follow(t, src, "secret/app/")
	rec.WaitFor(t, "the secret", sourcetest.Holds(map[string]string{"db/password": "before"}))
	n := len(mustSnaps(rec))
	proxy.Cut()
	rec.WaitFor(t, "the failure", sourcetest.Failing)
	srv.Put(t, "secret", "app/db", map[string]any{"password": "during"})
	if got := len(mustSnaps(rec)); got != n {
		t.Errorf("%d snapshots published during the outage", got-n)
	}
	if err := proxy.Restore(); err != nil {
		t.Fatal(err)
	}
	rec.WaitFor(t, "the recovery", sourcetest.Holds(map[string]string{"db/password": "during"}))
	rec.WaitFor(t, "health", sourcetest.Healthy)
	if logs.Count("source unavailable, keeping last content", "path=secret/app/") == 0 {
		t.Error("the outage was not logged")
	}
}

// TestLimits: a prefix with more secrets than its mounts may take, or a
// response over max_response_size, is an error wrapping
// source.ErrOverLimits and publishes nothing; a field over the value bound
// is oversized, kept out of the files and of what templates read.
func TestLimits(t *testing.T) {
	srv := vaulttest.Start(t)
	for i := range 5 {
		srv.Put(t, "secret", fmt.Sprintf("five/s%d", i), map[string]any{"v": "x"})
	}
	srv.Put(t, "secret", "big/s", map[string]any{"small": "x", "large": strings.Repeat("y", 4000)})
	src, _ := tokenSource(t, srv, "")
	many := sourcetest.FollowLimited(t, src, "secret/five/", source.Limits{MaxKeys: 3})
	many.WaitFor(t, "the bound", func(_ []source.Snapshot, err error) bool { return errors.Is(err, source.ErrOverLimits) })
	big := sourcetest.FollowLimited(t, src, "secret/big/", source.Limits{MaxValueSize: 1000})
	big.WaitFor(t, "the small field", sourcetest.Holds(map[string]string{"s/small": "x"}))
	last := sourcetest.Last(mustSnaps(big))
	if last.Oversized["s/large"] != 4000 {
		t.Errorf("oversized %v; want s/large of 4000 bytes", last.Oversized)
	}
	if data := last.Secrets["secret/data/big/s"].Data["data"].(map[string]any); data["large"] != nil || data["small"] != "x" {
		t.Errorf("templates read %v; want the large field left out", data)
	}
	tiny, _ := tokenSource(t, srv, "max_response_size = \"1KiB\"\n")
	huge := sourcetest.Follow(t, tiny, "secret/big/")
	huge.WaitFor(t, "the response bound", func(_ []source.Snapshot, err error) bool { return errors.Is(err, source.ErrOverLimits) })
}

// TestEnvironmentIsIgnored: the VAULT_* variables the API client reads
// change nothing: the token, address and namespace are the
// configuration's.
func TestEnvironmentIsIgnored(t *testing.T) {
	srv := vaulttest.Start(t)
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada"})
	proxy := newRecordingProxy(t, srv.URL())
	t.Setenv("VAULT_TOKEN", "from-the-environment")
	t.Setenv("VAULT_NAMESPACE", "elsewhere")
	t.Setenv("VAULT_ADDR", "http://127.0.0.1:1")
	t.Setenv("VAULT_HEADERS", `{"X-Injected": "yes"}`)
	tok := writeFile(t, t.TempDir(), "token", vaulttest.RootToken)
	src, _ := openTest(t, fmt.Sprintf("address = %q\ntoken_file = %q\npoll_interval = \"100ms\"\n", proxy.srv.URL, tok))
	rec := sourcetest.Follow(t, src, "secret/app/")
	rec.WaitFor(t, "the secret", sourcetest.Holds(map[string]string{"db/user": "ada"}))
	for _, r := range proxy.take() {
		if r.header.Get("X-Vault-Token") != vaulttest.RootToken || r.header.Get("X-Vault-Namespace") != "" || r.header.Get("X-Injected") != "" {
			t.Errorf("%s %s carried token %q, namespace %q, injected %q", r.method, r.path, r.header.Get("X-Vault-Token"), r.header.Get("X-Vault-Namespace"), r.header.Get("X-Injected"))
		}
	}
}

// TestTLS reads a server that serves https with a CA of its own: with the
// CA in tls.ca_file it is trusted; without, the source reports the
// certificate it cannot verify and publishes nothing.
func TestTLS(t *testing.T) {
	srv := vaulttest.StartTLS(t)
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada"})
	tok := writeFile(t, t.TempDir(), "token", vaulttest.RootToken)
	src, _ := openTest(t, fmt.Sprintf("address = %q\ntoken_file = %q\npoll_interval = \"100ms\"\n[sources.v.tls]\nca_file = %q\n", srv.URL(), tok, srv.CAFile()))
	rec := sourcetest.Follow(t, src, "secret/app/")
	rec.WaitFor(t, "the secret over https", sourcetest.Holds(map[string]string{"db/user": "ada"}))
	if got := src.cfg.PlainTCP(); got != nil {
		t.Errorf("PlainTCP = %v for https", got)
	}
	untrusted, _ := openTest(t, fmt.Sprintf("address = %q\ntoken_file = %q\npoll_interval = \"100ms\"\n", srv.URL(), tok))
	bad := sourcetest.Follow(t, untrusted, "secret/app/")
	bad.WaitFor(t, "the unverified certificate", func(snaps []source.Snapshot, err error) bool {
		return len(snaps) == 0 && err != nil && strings.Contains(err.Error(), "certificate")
	})
}
