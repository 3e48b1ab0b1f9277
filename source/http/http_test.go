package http

import (
	"encoding/pem"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/source"
)

// server is an httptest server holding one document, with ETag and
// Last-Modified support, and a switchable failure.
type server struct {
	*httptest.Server
	mu           sync.Mutex
	body         string
	etag         string
	versions     int // bodies set, which number the ETags
	lastModified time.Time
	useETag      bool
	fail         func(w http.ResponseWriter) bool // answers instead when it returns true
	requests     atomic.Int64
	notModified  atomic.Int64
	headers      http.Header
}

func newServer(t *testing.T, body string) *server {
	s := &server{useETag: true}
	s.setBody(body)
	s.Server = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.Close)
	return s
}

func (s *server) setBody(body string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.body = body
	// Each body its own ETag: one made from the body's length and the
	// clock's nanoseconds modulo 1,000 gave two bodies of one length the
	// same ETag about once in 1,000, and the source rightly took the
	// second for the first (If-None-Match, 304).
	s.versions++
	s.etag = fmt.Sprintf(`"v%d"`, s.versions)
	s.lastModified = time.Now().Add(time.Second).Truncate(time.Second)
}

func (s *server) serve(w http.ResponseWriter, r *http.Request) {
	s.requests.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.headers = r.Header.Clone()
	if s.fail != nil && s.fail(w) {
		return
	}
	if s.useETag {
		w.Header().Set("ETag", s.etag)
		if r.Header.Get("If-None-Match") == s.etag {
			s.notModified.Add(1)
			w.WriteHeader(http.StatusNotModified)
			return
		}
	} else {
		w.Header().Set("Last-Modified", s.lastModified.UTC().Format(http.TimeFormat))
		if since, err := http.ParseTime(r.Header.Get("If-Modified-Since")); err == nil && !s.lastModified.After(since) {
			s.notModified.Add(1)
			w.WriteHeader(http.StatusNotModified)
			return
		}
	}
	io.WriteString(w, s.body)
}

func newSource(t *testing.T, cfg *Config) *Source {
	t.Helper()
	if cfg.Format == "" {
		cfg.Format = FormatJSON
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 20 * time.Millisecond
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.MaxBodySize == 0 {
		cfg.MaxBodySize = DefaultMaxBodySize
	}
	src, err := New("web", cfg, sourcetest.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close() })
	return src
}

func follow(t *testing.T, src *Source, prefix string) *sourcetest.Recorder {
	t.Helper()
	return sourcetest.Follow(t, src, prefix)
}

func TestFollowJSON(t *testing.T) {
	srv := newServer(t, `{"app": {"a": "1", "dir": {"b": "2"}}, "other": "x"}`)
	rec := follow(t, newSource(t, &Config{URL: srv.URL}), "app/")
	rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "1", "dir/b": "2"}))
	srv.setBody(`{"app": {"a": "one", "dir": {"b": "2"}, "c": "3"}}`)
	rec.WaitFor(t, "update", sourcetest.Holds(map[string]string{"a": "one", "dir/b": "2", "c": "3"}))
	srv.setBody(`{"app": {"c": "3"}}`)
	rec.WaitFor(t, "delete", sourcetest.Holds(map[string]string{"c": "3"}))
	srv.setBody(`{"other": "x"}`)
	rec.WaitFor(t, "prefix gone", sourcetest.Missing)
}

// TestConditionalRequests checks that unchanged content is answered with
// 304 (by ETag, or by Last-Modified when there is none) and publishes
// nothing.
func TestConditionalRequests(t *testing.T) {
	for _, useETag := range []bool{true, false} {
		t.Run(fmt.Sprintf("etag=%v", useETag), func(t *testing.T) {
			srv := newServer(t, `{"a": "1"}`)
			srv.useETag = useETag
			rec := follow(t, newSource(t, &Config{URL: srv.URL}), "")
			rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "1"}))
			deadline := time.Now().Add(sourcetest.Timeout)
			for srv.notModified.Load() < 5 {
				if time.Now().After(deadline) {
					t.Fatalf("only %d of %d requests were answered 304", srv.notModified.Load(), srv.requests.Load())
				}
				time.Sleep(10 * time.Millisecond)
			}
			if snaps, err := rec.State(); len(snaps) != 1 || err != nil {
				t.Errorf("%d snapshots, status %v; want 1 and healthy", len(snaps), err)
			}
		})
	}
}

// TestFailuresKeepContent makes the server fail in several ways: the last
// content stays and the failure is reported, then recovery is seen.
func TestFailuresKeepContent(t *testing.T) {
	tests := []struct {
		name string
		fail func(w http.ResponseWriter) bool
		body string // served instead of a failure, when set
		want string // in the reported error
	}{
		{name: "500", fail: func(w http.ResponseWriter) bool { w.WriteHeader(500); return true }, want: "500 Internal Server Error"},
		{name: "503 without Retry-After", fail: func(w http.ResponseWriter) bool { w.WriteHeader(503); return true }, want: "503"},
		{name: "not JSON", body: `{"a": `, want: "not JSON"},
		{name: "number value", body: `{"a": "1", "n": {"port": 8080}}`, want: `key "n/port": value is a JSON number`},
		{name: "array", body: `["a"]`, want: "body is a JSON array"},
		{name: "too large", body: `{"a": "` + strings.Repeat("x", 2048) + `"}`, want: "larger than max_body_size"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, `{"a": "1"}`)
			src := newSource(t, &Config{URL: srv.URL, MaxBodySize: 1024})
			rec := follow(t, src, "")
			rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "1"}))
			if tt.fail != nil {
				srv.mu.Lock()
				srv.fail = tt.fail
				srv.mu.Unlock()
			} else {
				srv.setBody(tt.body)
			}
			rec.WaitFor(t, "failure", sourcetest.Failing)
			snaps, err := rec.State()
			last := sourcetest.Last(snaps)
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v; want %q", err, tt.want)
			}
			if string(last.Entries.ValueOf("a")) != "1" {
				t.Errorf("content changed on failure: %v", last.Entries.Map())
			}
			srv.mu.Lock()
			srv.fail = nil
			srv.mu.Unlock()
			srv.setBody(`{"a": "2"}`)
			rec.WaitFor(t, "recovery", sourcetest.Holds(map[string]string{"a": "2"}))
		})
	}
}

func TestRetryAfterIsHonoured(t *testing.T) {
	srv := newServer(t, `{"a": "1"}`)
	rec := follow(t, newSource(t, &Config{URL: srv.URL}), "")
	rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "1"}))
	srv.mu.Lock()
	srv.fail = func(w http.ResponseWriter) bool {
		w.Header().Set("Retry-After", "2")
		w.WriteHeader(http.StatusTooManyRequests)
		return true
	}
	srv.mu.Unlock()
	rec.WaitFor(t, "429", sourcetest.Failing)
	before := srv.requests.Load()
	time.Sleep(time.Second) // within the two seconds asked for
	if n := srv.requests.Load() - before; n != 0 {
		t.Errorf("%d requests during Retry-After", n)
	}
	srv.mu.Lock()
	srv.fail = nil
	srv.mu.Unlock()
	rec.WaitFor(t, "recovery", sourcetest.Healthy)
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 22, 1, 0, 0, 0, time.UTC)
	tests := []struct {
		value string
		want  time.Duration
		ok    bool
	}{
		{"120", 2 * time.Minute, true},
		{"0", time.Second, true},
		{"99999", MaxRetryAfter, true},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Hour).Format(http.TimeFormat), time.Second, true},
		{now.Add(24 * time.Hour).Format(http.TimeFormat), MaxRetryAfter, true},
		{"", 0, false},
		{"-5", 0, false},
		{"soon", 0, false},
	}
	for _, tt := range tests {
		got, ok := retryAfter(tt.value, now)
		if got != tt.want || ok != tt.ok {
			t.Errorf("retryAfter(%q) = %v, %v; want %v, %v", tt.value, got, ok, tt.want, tt.ok)
		}
	}
}

func TestFlatten(t *testing.T) {
	got, err := Flatten([]byte(`{"a": "1", "b": {"c": "2", "d": {"e": ""}}, "f/g": "3"}`))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"a": "1", "b/c": "2", "b/d/e": "", "f/g": "3"}
	if len(got) != len(want) {
		t.Fatalf("Flatten = %v; want %v", got, want)
	}
	for k, v := range want {
		if string(got[k]) != v {
			t.Errorf("%s = %q; want %q", k, got[k], v)
		}
	}
	for body, wantErr := range map[string]string{
		`{"a": true}`:                   `key "a": value is a JSON boolean`,
		`{"a": {"b": null}}`:            `key "a/b": value is a JSON null`,
		`{"a": [1]}`:                    `key "a": value is a JSON array`,
		`{"a/b": "1", "a": {"b": "2"}}`: `key "a/b" appears twice`,
		`"s"`:                           `body is a JSON string`,
		`{} {}`:                         `more than one JSON value`,
		`{}}`:                           `bytes after it`,
	} {
		if _, err := Flatten([]byte(body)); err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("Flatten(%s) = %v; want %q", body, err, wantErr)
		}
	}
}

func TestRawFormat(t *testing.T) {
	srv := newServer(t, "\x00\x01binary\xff")
	rec := follow(t, newSource(t, &Config{URL: srv.URL, Format: FormatRaw, Key: "blob.bin"}), "")
	rec.WaitFor(t, "raw body", sourcetest.Holds(map[string]string{"blob.bin": "\x00\x01binary\xff"}))
}

func TestNotFoundIsMissing(t *testing.T) {
	srv := newServer(t, `{}`)
	srv.fail = func(w http.ResponseWriter) bool { w.WriteHeader(http.StatusNotFound); return true }
	rec := follow(t, newSource(t, &Config{URL: srv.URL}), "")
	rec.WaitFor(t, "missing", sourcetest.Missing)
}

// TestOnePollerForEveryPrefix follows two prefixes of one source: the server
// must see one request per poll, not one per prefix.
// TestOnePollerForEveryPrefix: two prefixes of one source share one
// poller. The server holds each response longer than the poll interval, so
// two pollers would have requests in flight at once; one never does.
func TestOnePollerForEveryPrefix(t *testing.T) {
	var requests, inFlight, maxInFlight atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for m := maxInFlight.Load(); n > m && !maxInFlight.CompareAndSwap(m, n); m = maxInFlight.Load() {
		}
		requests.Add(1)
		time.Sleep(150 * time.Millisecond)
		io.WriteString(w, `{"a": {"x": "1"}, "b": {"y": "2"}}`)
	}))
	t.Cleanup(srv.Close)
	src := newSource(t, &Config{URL: srv.URL, PollInterval: 100 * time.Millisecond})
	a, b := follow(t, src, "a/"), follow(t, src, "b/")
	a.WaitFor(t, "a", sourcetest.Holds(map[string]string{"x": "1"}))
	b.WaitFor(t, "b", sourcetest.Holds(map[string]string{"y": "2"}))
	for start, deadline := requests.Load(), time.Now().Add(sourcetest.Timeout); requests.Load() < start+5; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("only %d requests", requests.Load()-start)
		}
	}
	if m := maxInFlight.Load(); m != 1 {
		t.Errorf("%d requests in flight at once for two prefixes; want one poller", m)
	}
}

func TestHeadersAreSent(t *testing.T) {
	srv := newServer(t, `{"a": "1"}`)
	tokenFile := t.TempDir() + "/token"
	if err := os.WriteFile(tokenFile, []byte("Bearer s3cr3t\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	toml := fmt.Sprintf("[sources.web]\ntype = \"http\"\nurl = %q\nheaders = { X-Env = \"prod\" }\nheader_files = { Authorization = %q }\n", srv.URL, tokenFile)
	cfg, err := config.Parse("h.toml", []byte(toml), map[string]config.SourceDecoder{"http": Decode})
	if err != nil {
		t.Fatal(err)
	}
	c := cfg.Sources["web"].Settings.(*Config)
	if s := fmt.Sprintf("%v %+v", c, c); strings.Contains(s, "s3cr3t") {
		t.Errorf("the header value is printed: %s", s)
	}
	rec := follow(t, newSource(t, c), "")
	rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "1"}))
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if srv.headers.Get("Authorization") != "Bearer s3cr3t" || srv.headers.Get("X-Env") != "prod" {
		t.Errorf("headers %v; want Authorization from the file and X-Env", srv.headers)
	}
}

func TestDecode(t *testing.T) {
	kinds := map[string]config.SourceDecoder{"http": Decode}
	tests := []struct {
		name    string
		toml    string
		wantErr string
	}{
		{name: "minimal", toml: "url = \"https://config.example.com/app.json\""},
		{name: "raw", toml: "url = \"http://x/blob\"\nformat = \"raw\"\nkey = \"blob\"\nmax_body_size = \"1MiB\"\ntimeout = \"2s\""},
		{name: "no url", toml: "format = \"json\"", wantErr: "h.toml:1: sources.web: url is missing"},
		{name: "bad url", toml: "url = \"ftp://x\"", wantErr: `sources.web.url: "ftp://x": want an http:// or https:// URL`},
		{name: "raw without key", toml: "url = \"http://x\"\nformat = \"raw\"", wantErr: `key: format "raw" needs key`},
		{name: "key with json", toml: "url = \"http://x\"\nkey = \"k\"", wantErr: `key: applies to format "raw" only`},
		{name: "watch", toml: "url = \"http://x\"\nchange_detection = \"watch\"", wantErr: `"watch": an http source can only poll`},
		{name: "bad size", toml: "url = \"http://x\"\nmax_body_size = \"big\"", wantErr: `max_body_size: bad size "big"`},
		{name: "missing header file", toml: "url = \"http://x\"\nheader_files = { Authorization = \"/nonexistent/token\" }", wantErr: `header_files.Authorization: open /nonexistent/token`},
		{name: "unknown key", toml: "url = \"http://x\"\npoll = \"1s\"", wantErr: `sources.web.poll: unknown key`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := config.Parse("h.toml", []byte("[sources.web]\ntype = \"http\"\n"+tt.toml+"\n"), kinds)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error = %v; want %q", err, tt.wantErr)
			}
		})
	}
}

// TestTLS fetches from an https:// server whose certificate is trusted only
// through ca_file.
func TestTLS(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"a": "over tls"}`)
	}))
	defer srv.Close()
	caFile := t.TempDir() + "/ca.pem"
	pemBytes := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(caFile, pemBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	untrusted := follow(t, newSource(t, &Config{URL: srv.URL}), "")
	untrusted.WaitFor(t, "certificate error", func(_ []source.Snapshot, err error) bool {
		return err != nil && strings.Contains(err.Error(), "certificate")
	})
	trusted := follow(t, newSource(t, &Config{URL: srv.URL, TLS: config.TLS{CAFile: caFile, CA: pemBytes, ServerName: "example.com"}}), "")
	trusted.WaitFor(t, "content over TLS", sourcetest.Holds(map[string]string{"a": "over tls"}))
}

// TestRedirectsKeepSecretHeadersAtHome: a redirect within the configured
// origin is followed, with the configured headers; one to another origin
// — another host, or https to http — is refused with an error that says
// to configure where it leads (issue 36, 13), and sends nothing there.
func TestRedirectsKeepSecretHeadersAtHome(t *testing.T) {
	elsewhere := newServer(t, `{"a": "elsewhere"}`)
	var home *httptest.Server
	var homeHeaders atomic.Value
	home = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/moved-here":
			http.Redirect(w, r, "/doc", http.StatusFound)
		case "/doc":
			homeHeaders.Store(r.Header.Clone())
			io.WriteString(w, `{"a": "home"}`)
		case "/moved-away":
			http.Redirect(w, r, elsewhere.URL+"/doc", http.StatusFound)
		}
	}))
	t.Cleanup(home.Close)
	tokenFile := t.TempDir() + "/token"
	if err := os.WriteFile(tokenFile, []byte("s3cr3t\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfgFor := func(url string) *Config {
		toml := fmt.Sprintf("[sources.web]\ntype = \"http\"\nurl = %q\nheaders = { X-Env = \"prod\" }\nheader_files = { X-Token = %q }\n", url, tokenFile)
		cfg, err := config.Parse("h.toml", []byte(toml), map[string]config.SourceDecoder{"http": Decode})
		if err != nil {
			t.Fatal(err)
		}
		return cfg.Sources["web"].Settings.(*Config)
	}

	rec := follow(t, newSource(t, cfgFor(home.URL+"/moved-here")), "")
	rec.WaitFor(t, "same origin", sourcetest.Holds(map[string]string{"a": "home"}))
	if h, _ := homeHeaders.Load().(http.Header); h.Get("X-Token") != "s3cr3t" || h.Get("X-Env") != "prod" {
		t.Errorf("same-origin redirect: headers %v; want X-Token and X-Env kept", h)
	}

	before := elsewhere.requests.Load()
	rec = follow(t, newSource(t, cfgFor(home.URL+"/moved-away")), "")
	rec.WaitFor(t, "other origin refused", func(_ []source.Snapshot, err error) bool {
		return err != nil && strings.Contains(err.Error(), "redirected to another origin") && strings.Contains(err.Error(), "configure that URL instead")
	})
	if n := elsewhere.requests.Load() - before; n != 0 {
		t.Errorf("the other origin got %d requests", n)
	}

	tlsHome := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, elsewhere.URL+"/doc", http.StatusFound)
	}))
	t.Cleanup(tlsHome.Close)
	cfg := cfgFor(tlsHome.URL)
	src := newSource(t, cfg)
	src.client.Transport.(*http.Transport).TLSClientConfig = tlsHome.Client().Transport.(*http.Transport).TLSClientConfig
	before = elsewhere.requests.Load()
	rec = follow(t, src, "")
	rec.WaitFor(t, "https to http refused", func(_ []source.Snapshot, err error) bool {
		return err != nil && strings.Contains(err.Error(), "redirected to another origin")
	})
	if n := elsewhere.requests.Load() - before; n != 0 {
		t.Errorf("the http server got %d requests after an https redirect", n)
	}
}

// TestCredentialsInTheURLNeverShow: a token in the URL's user information
// or query never reaches an error (which the log, /status and kvmount
// status show), whatever fails — the review found both in the log and on
// /status.
func TestCredentialsInTheURLNeverShow(t *testing.T) {
	srv := newServer(t, `{"a": "1"}`)
	u, _ := url.Parse(srv.URL)
	u.User = url.UserPassword("TOKENUSER", "TOKENPASS")
	u.RawQuery = "access_token=TOKENQUERY"
	var logs testlog.Buffer
	cfg := &Config{URL: u.String(), Format: FormatJSON, PollInterval: 20 * time.Millisecond, Timeout: time.Second, MaxBodySize: DefaultMaxBodySize}
	src, err := New("web", cfg, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	rec := follow(t, src, "")
	rec.WaitFor(t, "initial", sourcetest.Holds(map[string]string{"a": "1"}))
	srv.mu.Lock()
	srv.fail = func(w http.ResponseWriter) bool { w.WriteHeader(500); return true }
	srv.mu.Unlock()
	rec.WaitFor(t, "failure", sourcetest.Failing)
	_, ferr := rec.State()
	srv.Close() // now a connection error
	time.Sleep(200 * time.Millisecond)
	_, cerr := rec.State()
	for _, text := range []string{ferr.Error(), fmt.Sprint(cerr), logs.String()} {
		for _, secret := range []string{"TOKENUSER", "TOKENPASS", "TOKENQUERY"} {
			if strings.Contains(text, secret) {
				t.Errorf("%q shows %s", text, secret)
			}
		}
	}
	if !strings.Contains(ferr.Error(), "access_token=redacted") {
		t.Errorf("error %v does not name the URL, redacted", ferr)
	}
}
