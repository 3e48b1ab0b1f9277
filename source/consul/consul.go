// Package consul is the Consul KV source kind. In watch mode it follows
// every prefix of a source with at most four blocking queries (GET
// /v1/kv/PARENT?recurse&index=N, each on the longest prefix common to a
// group of them), however many prefixes and keys there are, and applies
// Consul's rules for blocking queries (api-docs/features/blocking): the
// index is reset when it goes backwards, never sent below 1, a return
// without change is no change, and such returns are rate-limited with a
// token bucket so a misbehaving server cannot make kvmount spin. In poll
// mode it reads the prefix every poll_interval.
package consul

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/peercred"
	"github.com/kvmount/kvmount/source"
)

// Defaults of a [sources.NAME] table of type "consul".
const (
	DefaultAddress      = "http://127.0.0.1:8500"
	DefaultWait         = 5 * time.Minute
	DefaultPollInterval = 30 * time.Second
	// MaxWait is the longest wait Consul accepts for a blocking query.
	MaxWait = 10 * time.Minute
	// minProbeInterval is the shortest probe_interval.
	minProbeInterval = 100 * time.Millisecond
)

// Change detection strategies and consistency modes.
const (
	Watch = "watch"
	Poll  = "poll"

	ConsistencyDefault    = "default"
	ConsistencyStale      = "stale"
	ConsistencyConsistent = "consistent"
)

// Rate limit of blocking queries that return without a change: a burst of
// idleBurst, then one per idleEvery. Consul's documentation suggests
// degrading to about one call per 15 s when results keep returning
// unchanged.
const (
	idleEvery = 15 * time.Second
	idleBurst = 5
)

// Config is a decoded [sources.NAME] table of type "consul".
type Config struct {
	// Address is the agent's URL with scheme: http:// or https://.
	Address string
	// Token is the ACL token, read from token_file.
	Token config.Secret
	// Datacenter to query; empty for the agent's own.
	Datacenter string
	// Consistency is ConsistencyDefault (the leader answers),
	// ConsistencyStale (any server answers) or ConsistencyConsistent (the
	// leader confirms its leadership first).
	Consistency string
	// Wait is the blocking query's wait; Consul adds up to Wait/16 of
	// jitter.
	Wait time.Duration
	// TLS configures https:// addresses.
	TLS config.TLS
	// ChangeDetection is Watch or Poll.
	ChangeDetection string
	// PollInterval is the period of Poll.
	PollInterval time.Duration
	// ProbeInterval is how often the liveness probe reads the agent in
	// watch mode (liveness.go); MaxStale is the longest an answering
	// server's last contact with its leader may be for its answer to
	// count as current (X-Consul-LastContact).
	ProbeInterval time.Duration
	MaxStale      time.Duration
	// PeerUID, when ≥ 0, is the user the agent must run as (peer_user):
	// every connection to it is checked (peercred), so that a local user
	// who takes its port while it is down feeds nothing and receives no
	// token. -1 checks nothing.
	PeerUID int
}

// PlainTCP returns the address when it is reached over plain TCP without a
// peer_user check (config.PlainTCP).
func (c *Config) PlainTCP() []string {
	if c.PeerUID >= 0 || !strings.HasPrefix(c.Address, "http://") {
		return nil
	}
	return []string{c.Address}
}

// StoreURLs returns the URLs the source connects to (config.StoreURLs).
func (c *Config) StoreURLs() []string {
	return []string{c.Address}
}

// Kind returns the Consul source kind for the registry.
func Kind() source.Kind {
	return source.Kind{Name: "consul", Decode: Decode, Open: open}
}

// Decode reads a [sources.NAME] table of type "consul", reporting problems
// through sec. It returns a *Config.
func Decode(sec *config.Section) any {
	c := &Config{
		Address:         sec.String("address", DefaultAddress),
		Token:           sec.SecretFile("token_file"),
		Datacenter:      sec.String("datacenter", ""),
		Consistency:     sec.Choice("consistency", ConsistencyDefault, ConsistencyDefault, ConsistencyStale, ConsistencyConsistent),
		Wait:            sec.Duration("wait", DefaultWait),
		TLS:             sec.TLS("tls"),
		ChangeDetection: sec.Choice("change_detection", Watch, Watch, Poll),
		PollInterval:    sec.DurationAtLeast("poll_interval", DefaultPollInterval, config.MinPollInterval),
		PeerUID:         sec.UserID("peer_user"),
		ProbeInterval:   sec.DurationAtLeast("probe_interval", DefaultProbeInterval, minProbeInterval),
		MaxStale:        sec.Duration("max_stale", DefaultMaxStale),
	}
	u, err := url.Parse(c.Address)
	switch {
	case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
		sec.Errorf("address", "%q: want a URL with scheme http or https, such as %q", c.Address, DefaultAddress)
	case u.Path != "" && u.Path != "/":
		sec.Errorf("address", "%q: want no path", c.Address)
	}
	if c.MaxStale <= 0 {
		sec.Errorf("max_stale", "%v: want a positive duration, such as %q", c.MaxStale, DefaultMaxStale.String())
	}
	if c.Wait > MaxWait {
		sec.Errorf("wait", "%v is longer than Consul's maximum of %v", c.Wait, MaxWait)
	}
	sec.WarnURLCredentials("address", c.Address, !c.Token.IsZero())
	return c
}

func open(name string, settings any, env source.Env) (source.Source, error) {
	c, ok := settings.(*Config)
	if !ok {
		return nil, fmt.Errorf("source/consul: settings are %T, not *consul.Config", settings)
	}
	return New(name, c, env.Log)
}

// Source follows prefixes of one Consul agent.
type Source struct {
	name      string
	cfg       *Config
	log       *slog.Logger
	client    *api.Client
	transport *http.Transport

	// fanout runs the watcher every Follow shares: it starts with the
	// first Follow and stops after the last.
	fanout *source.Fanout

	mu        sync.Mutex
	groups    []string            // the prefixes the running queries read
	lists     map[string]*listing // the latest listing of each group
	followers []*follower         // every Follow's state, sorted by prefix
	regroup   context.CancelFunc  // stops the running queries to group anew
	// highest is the highest index published for each group, kept
	// across the failures and restarts of its query: a lower one is
	// published only once a consistent read confirms it (never backwards).
	highest map[string]uint64
	// unhealthy is the liveness probe's failure, nil while it passes
	// (liveness.go).
	unhealthy error
	// passed is closed, and replaced, whenever the liveness probe
	// passes: a query waiting out its backoff after the store's own
	// failure tries again then (nextPass).
	passed chan struct{}
}

var _ source.Source = (*Source)(nil)

// New returns a Source for cfg. It does not connect; Follow does.
func New(name string, cfg *Config, log *slog.Logger) (*Source, error) {
	u, err := url.Parse(cfg.Address)
	if err != nil {
		return nil, fmt.Errorf("source/consul: %w", err)
	}
	// The files' content, read by config as credential files are; never
	// their paths, which the API client would read following symlinks.
	tlsConfig := api.TLSConfig{
		Address: cfg.TLS.ServerName,
		CAPem:   cfg.TLS.CA,
		CertPEM: cfg.TLS.Cert,
		KeyPEM:  []byte(cfg.TLS.Key.Reveal()),
	}
	transport := api.DefaultConfig().Transport
	transport.DisableCompression = loopback(u.Hostname())
	if cfg.PeerUID >= 0 {
		dial := transport.DialContext
		transport.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			if err := peercred.Check(c, cfg.PeerUID); err != nil {
				c.Close()
				return nil, fmt.Errorf("source/consul: %s: %w", addr, err)
			}
			return c, nil
		}
	}
	// kvmount's own TLS settings, not the CONSUL_* environment's.
	httpClient, err := api.NewHttpClient(transport, tlsConfig)
	if err != nil {
		return nil, fmt.Errorf("source/consul: tls: %w", err)
	}
	httpClient.Transport = configOnly{next: httpClient.Transport, token: cfg.Token.Reveal()}
	client, err := api.NewClient(&api.Config{
		Address:    u.Host,
		Scheme:     u.Scheme,
		Datacenter: cfg.Datacenter,
		Transport:  transport,
		HttpClient: httpClient,
		TLSConfig:  tlsConfig,
		Token:      cfg.Token.Reveal(),
	})
	if err != nil {
		return nil, fmt.Errorf("source/consul: %w", err)
	}
	s := &Source{name: name, cfg: cfg, log: log, client: client, transport: transport, lists: map[string]*listing{}, highest: map[string]uint64{}, passed: make(chan struct{})}
	s.fanout = source.NewFanout(s.watch)
	return s, nil
}

// loopback reports whether host is "localhost" or a loopback address
// (127.0.0.0/8, ::1): the usual place of a Consul agent, one on every node.
//
// Responses from such an agent are read uncompressed. Go's transport asks
// for gzip by default and the agent compresses a large listing: 1,000 keys
// (168 KB of JSON) took 4–7.5 ms to the last byte gzipped and 1.9–4 ms
// plain on this project's test machine, and a change re-reads its whole
// group. Over a network the 25-fold smaller body is worth the CPU, so a
// remote agent's responses stay compressed.
func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// configOnly makes every request to Consul carry only what kvmount's
// configuration says. The Consul API client fills settings the
// configuration leaves empty from CONSUL_HTTP_TOKEN, CONSUL_HTTP_TOKEN_FILE,
// CONSUL_NAMESPACE and CONSUL_PARTITION; a daemon's reads must not change
// with the environment it happens to be started in, so the token header and
// the ns and partition parameters are replaced by the configured ones (none
// of the latter two: kvmount reads the default namespace and partition).
// TLS comes from the configuration already: the HTTP client is built from
// it, not from CONSUL_CACERT and friends.
type configOnly struct {
	next  http.RoundTripper
	token string
}

// bodyLimitKey is the context key of a request's response size bound.
type bodyLimitKey struct{}

// withBodyLimit returns ctx with limit, in bytes, the most a response to a
// request made with it may carry (0: no bound).
func withBodyLimit(ctx context.Context, limit int64) context.Context {
	if limit <= 0 {
		return ctx
	}
	return context.WithValue(ctx, bodyLimitKey{}, limit)
}

// RoundTrip sends a copy of req with only the configured token, namespace
// and partition; a response to a request whose context carries a bound
// (withBodyLimit) fails once its body passes it.
func (c configOnly) RoundTrip(req *http.Request) (*http.Response, error) {
	req = req.Clone(req.Context())
	q := req.URL.Query()
	if q.Has("ns") || q.Has("partition") {
		q.Del("ns")
		q.Del("partition")
		req.URL.RawQuery = q.Encode()
	}
	req.Header.Del("X-Consul-Token")
	req.Header.Del("Authorization")
	if c.token != "" {
		req.Header.Set("X-Consul-Token", c.token)
	}
	resp, err := c.next.RoundTrip(req)
	if limit, ok := req.Context().Value(bodyLimitKey{}).(int64); ok && err == nil {
		if resp.ContentLength > limit {
			resp.Body.Close()
			return nil, fmt.Errorf("source/consul: a response of %d bytes %w", resp.ContentLength, source.ErrOverLimits)
		}
		resp.Body = source.LimitBody(resp.Body, limit)
	}
	return resp, err
}

// Close releases idle connections.
func (s *Source) Close() error {
	s.transport.CloseIdleConnections()
	return nil
}

// nextIndex returns the index for the next blocking query after one that
// used index and returned got, by Consul's rules: reset to 0 (a fresh,
// non-blocking read) when the index went backwards, as after a snapshot
// restore or an agent restart; never below 1 otherwise, since index 0 does
// not block.
func nextIndex(index, got uint64) uint64 {
	switch {
	case got < index:
		return 0
	case got < 1:
		return 1
	}
	return got
}

// list reads prefix in the consistency mode consistency, blocking while
// its index is index (0: no blocking). A missing prefix returns nil pairs.
// In stale mode an answer from a server that knows no leader, or last
// heard from it longer than max_stale ago, is an error (judge).
func (s *Source) list(ctx context.Context, prefix string, index uint64, consistency string) (api.KVPairs, *api.QueryMeta, error) {
	// The server answers by Wait plus up to Wait/16 of jitter; past that,
	// the connection is taken for lost.
	timeout := s.cfg.Wait + s.cfg.Wait/16 + 10*time.Second
	qctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	q := &api.QueryOptions{
		WaitIndex:         index,
		WaitTime:          s.cfg.Wait,
		AllowStale:        consistency == ConsistencyStale,
		RequireConsistent: consistency == ConsistencyConsistent,
	}
	pairs, meta, err := s.client.KV().List(prefix, q.WithContext(qctx))
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			err = fmt.Errorf("no answer within %v", timeout)
		}
		return nil, nil, fmt.Errorf("source/consul: list %s: %w", prefix, err)
	}
	if consistency == ConsistencyStale {
		if err := judge(meta, s.cfg.MaxStale); err != nil {
			return nil, nil, fmt.Errorf("source/consul: list %s: %w", prefix, err)
		}
	}
	return pairs, meta, nil
}
