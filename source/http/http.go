// Package http is the polled HTTP source kind: it GETs one URL every
// poll_interval (±10 %) with conditional requests (If-None-Match,
// If-Modified-Since; a 304 keeps the content), honours Retry-After on 429
// and 503, and backs off exponentially on other failures, keeping the last
// content meanwhile. The body is a JSON object of keys to strings (nested
// objects flatten to "a/b" keys) or, with format "raw", one key. One poller
// per source serves every prefix that mounts follow.
package http

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/origin"
	"github.com/kvmount/kvmount/source"
)

// Defaults of a [sources.NAME] table of type "http".
const (
	DefaultPollInterval = 30 * time.Second
	DefaultTimeout      = 10 * time.Second
	// DefaultMaxBodySize is 4 MiB.
	DefaultMaxBodySize = 4 << 20
	// MaxRetryAfter caps the wait a server may ask for with Retry-After.
	MaxRetryAfter = 15 * time.Minute
)

// Body formats.
const (
	FormatJSON = "json"
	FormatRaw  = "raw"
)

// Config is a decoded [sources.NAME] table of type "http".
type Config struct {
	// URL is fetched with GET; http:// or https://.
	URL string
	// Format is FormatJSON or FormatRaw.
	Format string
	// Key names the whole body with FormatRaw.
	Key string
	// PollInterval is the period between requests.
	PollInterval time.Duration
	// Timeout bounds one request, body included.
	Timeout time.Duration
	// Headers are sent with every request.
	Headers map[string]string
	// HeaderFiles are headers whose values were read from files, such as
	// an Authorization token; never logged.
	HeaderFiles map[string]config.Secret
	// TLS configures https:// URLs.
	TLS config.TLS
	// MaxBodySize is the largest body accepted, in bytes; a larger one is
	// an error and the content is kept.
	MaxBodySize int64
}

// PlainTCP returns the URL when it is fetched over plain TCP, http://
// (config.PlainTCP).
func (c *Config) PlainTCP() []string {
	if strings.HasPrefix(c.URL, "http://") {
		return []string{c.URL}
	}
	return nil
}

// StoreURLs returns the URLs the source connects to (config.StoreURLs).
func (c *Config) StoreURLs() []string {
	return []string{c.URL}
}

// Kind returns the HTTP source kind for the registry.
func Kind() source.Kind {
	return source.Kind{Name: "http", Decode: Decode, Open: open}
}

// Decode reads a [sources.NAME] table of type "http", reporting problems
// through sec. It returns a *Config.
func Decode(sec *config.Section) any {
	c := &Config{
		URL:          sec.String("url", ""),
		Format:       sec.Choice("format", FormatJSON, FormatJSON, FormatRaw),
		Key:          sec.String("key", ""),
		PollInterval: sec.DurationAtLeast("poll_interval", DefaultPollInterval, config.MinPollInterval),
		Timeout:      sec.Duration("timeout", DefaultTimeout),
		Headers:      sec.StringMap("headers"),
		TLS:          sec.TLS("tls"),
		MaxBodySize:  sec.Size("max_body_size", DefaultMaxBodySize),
	}
	if cd := sec.String("change_detection", "poll"); cd != "poll" {
		sec.Errorf("change_detection", "%q: an http source can only poll", cd)
	}
	u, err := url.Parse(c.URL)
	switch {
	case c.URL == "":
		sec.Errorf("", "url is missing")
	case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
		sec.Errorf("url", "%q: want an http:// or https:// URL", c.URL)
	}
	switch {
	case c.Format == FormatRaw && c.Key == "":
		sec.Errorf("key", "format \"raw\" needs key, the name the body is projected as")
	case c.Format == FormatJSON && c.Key != "":
		sec.Errorf("key", "applies to format \"raw\" only")
	}
	c.HeaderFiles = sec.SecretFileMap("header_files")
	for name := range c.HeaderFiles {
		if _, dup := c.Headers[name]; dup {
			sec.Errorf("header_files", "header %q is also in headers", name)
		}
	}
	sec.WarnInlineCredentials("headers", c.Headers)
	sec.WarnURLCredentials("url", c.URL, len(c.Headers)+len(c.HeaderFiles) > 0)
	return c
}

func open(name string, settings any, env source.Env) (source.Source, error) {
	c, ok := settings.(*Config)
	if !ok {
		return nil, fmt.Errorf("source/http: settings are %T, not *http.Config", settings)
	}
	return New(name, c, env.Log)
}

// Source polls one URL for every prefix followed.
type Source struct {
	name   string
	cfg    *Config
	log    *slog.Logger
	client *http.Client
	// fanout runs the one poller every Follow shares.
	fanout *source.Fanout

	mu  sync.Mutex
	doc *document // the last body read, nil before the first
	err error     // the last failure, nil after a success
}

var _ source.Source = (*Source)(nil)

// document is one parsed body.
type document struct {
	revision string
	missing  bool // 404
	entries  kvset.Set
}

// New returns a Source for cfg. It sends nothing until the first Follow.
func New(name string, cfg *Config, log *slog.Logger) (*Source, error) {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	if cfg.TLS.Enabled() {
		tc, err := cfg.TLS.Config()
		if err != nil {
			return nil, err
		}
		transport.TLSClientConfig = tc
	}
	s := &Source{
		name: name,
		cfg:  cfg,
		log:  log,
	}
	s.client = &http.Client{Transport: transport, Timeout: cfg.Timeout, CheckRedirect: origin.CheckRedirect()}
	s.fanout = source.NewFanout(s.poll)
	return s, nil
}

// Close releases idle connections. No Follow may be running.
func (s *Source) Close() error {
	s.client.CloseIdleConnections()
	return nil
}

// Follow publishes the keys under prefix of every body the source's poller
// reads, until ctx is done; see source.Source. The first Follow starts the
// poller, the last one to end stops it. A prefix under which the body holds
// no key, or a 404, is a missing prefix.
func (s *Source) Follow(ctx context.Context, prefix string, pub source.Publisher) error {
	f := s.fanout.Join(prefix)
	defer s.fanout.Leave(f)
	var last kvset.Set
	published := false
	var lastDoc *document
	var lastErr error
	for {
		s.mu.Lock()
		doc, err := s.doc, s.err
		s.mu.Unlock()
		if doc != nil && doc != lastDoc {
			lastDoc = doc
			entries := doc.entries.Under(prefix)
			if !published || !kvset.Equal(entries, last) {
				last, published = entries, true
				pub.Publish(source.Snapshot{Revision: doc.revision, Missing: doc.missing || entries.Len() == 0, Entries: entries})
				lastErr = nil
			}
		}
		if (err == nil) != (lastErr == nil) || err != nil && err.Error() != lastErr.Error() {
			pub.Status(err)
			lastErr = err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-f.Wake:
		}
	}
}

// set records a poll's outcome and wakes every follower.
func (s *Source) set(doc *document, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if doc != nil {
		s.doc = doc
	}
	s.err = err
	s.fanout.Wake(nil)
}

// poll fetches the URL until ctx is done: every poll interval after a
// success or a 304, after Retry-After on 429 and 503, with exponential
// backoff after other failures.
func (s *Source) poll(ctx context.Context) {
	var v validators
	bo := source.NewBackoff()
	for {
		doc, next, err := s.fetch(ctx, &v)
		if ctx.Err() != nil {
			return
		}
		var wait time.Duration
		var retry *retryAfterError
		switch {
		case errors.As(err, &retry):
			wait = retry.wait
		case err != nil:
			wait = bo.NextBackOff()
		default:
			bo.Reset()
			wait = source.Jitter(s.cfg.PollInterval)
		}
		if err != nil {
			s.log.Warn("source unavailable, keeping last content", "url", origin.Redact(s.cfg.URL), "err", err, "retry_in", wait)
		}
		s.set(doc, err)
		v = next
		if !source.Sleep(ctx, wait) {
			return
		}
	}
}

// validators are what a conditional GET sends back (RFC 9110 §13.1).
type validators struct {
	etag         string
	lastModified string
}

// retryAfterError is a 429 or 503, with the wait the server asked for.
type retryAfterError struct {
	status int
	wait   time.Duration
}

func (e *retryAfterError) Error() string {
	return fmt.Sprintf("%d %s, retrying in %v", e.status, http.StatusText(e.status), e.wait)
}

// fetch makes one conditional GET. It returns the new document (nil when
// the content did not change) and the validators for the next request.
func (s *Source) fetch(ctx context.Context, v *validators) (*document, validators, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.cfg.URL, nil)
	if err != nil {
		return nil, *v, fmt.Errorf("source/http: %w", err)
	}
	for name, value := range s.cfg.Headers {
		req.Header.Set(name, value)
	}
	for name, value := range s.cfg.HeaderFiles {
		req.Header.Set(name, value.Reveal())
	}
	// If-None-Match takes precedence when both are sent (RFC 9110 §13.1.3).
	if v.etag != "" {
		req.Header.Set("If-None-Match", v.etag)
	}
	if v.lastModified != "" {
		req.Header.Set("If-Modified-Since", v.lastModified)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, *v, fmt.Errorf("source/http: GET %s: %w", origin.Redact(s.cfg.URL), unwrapURLError(err))
	}
	defer func() {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, s.cfg.MaxBodySize))
		resp.Body.Close()
	}()
	next := validators{etag: resp.Header.Get("ETag"), lastModified: resp.Header.Get("Last-Modified")}
	switch {
	case resp.StatusCode == http.StatusNotModified:
		// A 304 may refresh the validators; absent ones stay.
		if next.etag == "" {
			next.etag = v.etag
		}
		if next.lastModified == "" {
			next.lastModified = v.lastModified
		}
		return nil, next, nil
	case resp.StatusCode == http.StatusOK:
	case resp.StatusCode == http.StatusNotFound:
		return &document{revision: "404", missing: true}, validators{}, nil
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable:
		if wait, ok := retryAfter(resp.Header.Get("Retry-After"), time.Now()); ok {
			return nil, *v, &retryAfterError{status: resp.StatusCode, wait: wait}
		}
		return nil, *v, fmt.Errorf("source/http: GET %s: %s", origin.Redact(s.cfg.URL), resp.Status)
	default:
		return nil, *v, fmt.Errorf("source/http: GET %s: %s", origin.Redact(s.cfg.URL), resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, s.cfg.MaxBodySize+1))
	if err != nil {
		return nil, *v, fmt.Errorf("source/http: GET %s: %w", origin.Redact(s.cfg.URL), err)
	}
	if int64(len(body)) > s.cfg.MaxBodySize {
		return nil, *v, fmt.Errorf("source/http: GET %s: body larger than max_body_size (%d bytes)", origin.Redact(s.cfg.URL), s.cfg.MaxBodySize)
	}
	entries, err := s.parse(body)
	if err != nil {
		return nil, *v, fmt.Errorf("source/http: %s: %w", origin.Redact(s.cfg.URL), err)
	}
	revision := next.etag
	if revision == "" {
		sum := sha256.Sum256(body)
		revision = "sha256:" + hex.EncodeToString(sum[:8])
	}
	return &document{revision: revision, entries: kvset.FromMap(entries)}, next, nil
}

// parse turns a body into entries by the source's format.
func (s *Source) parse(body []byte) (map[string][]byte, error) {
	if s.cfg.Format == FormatRaw {
		return map[string][]byte{s.cfg.Key: body}, nil
	}
	return Flatten(body)
}

// Flatten parses a JSON object whose values are strings or objects of the
// same kind, and returns its keys flattened with "/": {"a": {"b": "v"}}
// gives "a/b" = "v". Any other value is an error naming its key.
func Flatten(body []byte) (map[string][]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var root any
	if err := dec.Decode(&root); err != nil {
		return nil, fmt.Errorf("body is not JSON: %w", err)
	}
	// Anything after the value — a second value or stray bytes such as
	// "{}}" — is an error (dec.More alone misses a stray "}" or "]").
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("body holds more than one JSON value, or bytes after it")
	}
	obj, ok := root.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("body is a JSON %s; want an object of keys to strings", jsonType(root))
	}
	out := map[string][]byte{}
	if err := flatten(out, "", obj); err != nil {
		return nil, err
	}
	return out, nil
}

func flatten(out map[string][]byte, prefix string, obj map[string]any) error {
	for k, v := range obj {
		key := prefix + k
		switch v := v.(type) {
		case string:
			if _, dup := out[key]; dup {
				return fmt.Errorf("key %q appears twice", key)
			}
			out[key] = []byte(v)
		case map[string]any:
			if err := flatten(out, key+"/", v); err != nil {
				return err
			}
		default:
			return fmt.Errorf("key %q: value is a JSON %s; want a string or an object", key, jsonType(v))
		}
	}
	return nil
}

func jsonType(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "boolean"
	case json.Number:
		return "number"
	case []any:
		return "array"
	case map[string]any:
		return "object"
	case string:
		return "string"
	}
	return fmt.Sprintf("%T", v)
}

// retryAfter parses a Retry-After value: delay-seconds or an HTTP-date
// (RFC 9110 §10.2.3), capped at MaxRetryAfter and at least one second.
func retryAfter(value string, now time.Time) (time.Duration, bool) {
	value = strings.TrimSpace(value)
	if value == "" {
		return 0, false
	}
	var d time.Duration
	if secs, err := strconv.ParseInt(value, 10, 64); err == nil {
		if secs < 0 {
			return 0, false
		}
		d = time.Duration(min(secs, int64(MaxRetryAfter/time.Second))) * time.Second
	} else if t, err := http.ParseTime(value); err == nil {
		d = t.Sub(now)
	} else {
		return 0, false
	}
	return min(max(d, time.Second), MaxRetryAfter), true
}

// unwrapURLError drops *url.Error's own rendering of the URL, which would
// repeat it (unredacted).
func unwrapURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}
