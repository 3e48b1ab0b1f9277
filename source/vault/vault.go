// Package vault is the Vault source kind, for HashiCorp Vault and OpenBao
// (which serve the same HTTP API), through the MPL-2.0 API client
// github.com/hashicorp/vault/api.
//
// A projection names either a path — every secret of a KV engine (v2 or
// v1) below "secret/app/", one secret "secret/app/db", or a dynamic secret
// such as "database/creds/app" — or, with [mount.pki], a certificate a PKI
// role issues. A KV secret's fields become files below its path; a
// certificate becomes certificate, private_key, issuing_ca and ca_chain, in
// one snapshot, so that a mount switches them together.
//
// Vault has no blocking queries: KV prefixes are polled every
// poll_interval (±10 %), and only the secrets whose current_version
// changed are read (the metadata endpoint), so an idle poll costs the
// secrets' metadata, not their data. A certificate is issued again at two
// thirds of its validity; a lease is renewed at two thirds of its duration
// while it can be, read again before its maximum TTL, and revoked when no
// mount follows it any more (source.ErrReleased). The source's own token
// — from token_file or an AppRole login — is renewed the same way, and
// replaced (the file read again, or a new login) when it cannot be renewed
// or is revoked. A token or a secret's value never reaches a log line, an
// error, /status or a metric.
package vault

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/hashicorp/vault/api"
	"golang.org/x/time/rate"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/source"
)

// Defaults of a [sources.NAME] table of type "vault".
const (
	DefaultPollInterval = time.Minute
	DefaultTimeout      = 30 * time.Second
	// DefaultMaxResponseSize bounds one response, 4 MiB.
	DefaultMaxResponseSize = 4 << 20
	// DefaultAppRoleMount is the AppRole auth method's default path.
	DefaultAppRoleMount = "approle"
)

// Config is a decoded [sources.NAME] table of type "vault".
type Config struct {
	// Address is the server's URL: http:// or https://, no path.
	Address string
	// Namespace is the Vault Enterprise or OpenBao namespace every
	// request is made in; "" for the root namespace.
	Namespace string
	// TLS configures https:// addresses.
	TLS config.TLS
	// TokenFile holds the token (token_file), read at load and again when
	// the token can no longer be used (a vault-agent sink rotates it);
	// Token is what the load read.
	TokenFile string
	Token     config.Secret
	// AppRole, when not nil, logs in with AppRole instead of a token file.
	AppRole *AppRole
	// PollInterval is the period of KV polls and of reads of paths
	// without a lease.
	PollInterval time.Duration
	// Timeout bounds one request.
	Timeout time.Duration
	// MaxResponseSize is the largest response read, in bytes.
	MaxResponseSize int64
	// RevokeOnRemove revokes a projection's leases (dynamic secrets,
	// certificates issued with the role's generate_lease) when no mount
	// follows it any more (revoke_on_remove, default true); the daemon's
	// stop and restart never revoke.
	RevokeOnRemove bool
}

// AppRole is a [sources.NAME.approle] table.
type AppRole struct {
	// RoleIDFile and SecretIDFile hold the role's credentials, read at
	// load and again at every login; RoleID and SecretID are what the load
	// read.
	RoleIDFile, SecretIDFile string
	RoleID, SecretID         config.Secret
	// Mount is the auth method's path ("approle").
	Mount string
}

// PlainTCP returns the address when it is reached over plain TCP,
// http:// (config.PlainTCP).
func (c *Config) PlainTCP() []string {
	if strings.HasPrefix(c.Address, "http://") {
		return []string{c.Address}
	}
	return nil
}

// StoreURLs returns the URLs the source connects to (config.StoreURLs).
func (c *Config) StoreURLs() []string {
	return []string{c.Address}
}

// RereadFiles implements config.RereadFiles: token_file, or AppRole's
// role_id_file and secret_id_file, read again at every login.
func (c *Config) RereadFiles() []string {
	if c.AppRole != nil {
		return []string{c.AppRole.RoleIDFile, c.AppRole.SecretIDFile}
	}
	if c.TokenFile != "" {
		return []string{c.TokenFile}
	}
	return nil
}

// Kind returns the Vault source kind for the registry.
func Kind() source.Kind {
	return source.Kind{Name: "vault", Decode: Decode, Open: open}
}

// Decode reads a [sources.NAME] table of type "vault", reporting problems
// through sec. It returns a *Config.
func Decode(sec *config.Section) any {
	c := &Config{
		Address:         sec.String("address", ""),
		Namespace:       strings.Trim(sec.String("namespace", ""), "/"),
		TLS:             sec.TLS("tls"),
		PollInterval:    sec.DurationAtLeast("poll_interval", DefaultPollInterval, config.MinPollInterval),
		Timeout:         sec.Duration("timeout", DefaultTimeout),
		MaxResponseSize: sec.Size("max_response_size", DefaultMaxResponseSize),
		RevokeOnRemove:  sec.Bool("revoke_on_remove", true),
	}
	u, err := url.Parse(c.Address)
	switch {
	case c.Address == "":
		sec.Errorf("", "address is missing, such as \"https://vault.example:8200\"")
	case err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "":
		sec.Errorf("address", "%q: want a URL with scheme http or https, such as \"https://vault.example:8200\"", c.Address)
	case u.Path != "" && u.Path != "/" || u.RawQuery != "" || u.User != nil:
		sec.Errorf("address", "%q: want scheme, host and port only", c.Address)
	}
	if cd := sec.String("change_detection", "poll"); cd != "poll" {
		sec.Errorf("change_detection", "%q: a vault source polls (Vault's event subscriptions are an Enterprise feature)", cd)
	}
	c.TokenFile = sec.String("token_file", "")
	c.Token = sec.SecretFile("token_file")
	if sec.Has("approle") {
		a := sec.Table("approle")
		c.AppRole = &AppRole{
			RoleIDFile:   a.String("role_id_file", ""),
			RoleID:       a.SecretFile("role_id_file"),
			SecretIDFile: a.String("secret_id_file", ""),
			SecretID:     a.SecretFile("secret_id_file"),
			Mount:        strings.Trim(a.String("mount", DefaultAppRoleMount), "/"),
		}
		if c.AppRole.RoleIDFile == "" {
			a.Errorf("", "role_id_file is missing")
		}
		if c.AppRole.SecretIDFile == "" {
			a.Errorf("", "secret_id_file is missing")
		}
		a.Done()
	}
	switch {
	case c.TokenFile != "" && c.AppRole != nil:
		sec.Errorf("approle", "a vault source authenticates with token_file or [approle], not both")
	case c.TokenFile == "" && c.AppRole == nil:
		sec.Errorf("", "no credentials: set token_file (such as a vault-agent sink) or an [approle] table")
	}
	if c.Address != "" {
		sec.WarnURLCredentials("address", c.Address, true)
	}
	return c
}

// DecodeProjection reads a projection of this source (config.ProjectionDecoder):
// either prefix, a path (KV: every secret below "secret/app/", or the one
// secret "secret/app/db"; another engine: the one path read, such as
// "database/creds/app"), or a [pki] table. It returns the prefix the
// source follows: the path, or the issue request of a PKI projection
// (pkiRequest.String). It warns about a projection into a disk mount — its
// secrets would be written to disk — and refuses a certificate in an
// immutable mount, which is read once and would expire.
func (c *Config) DecodeProjection(sec *config.Section, m *config.Mount) string {
	prefix := sec.String("prefix", "")
	var out string
	if sec.Has("pki") {
		if prefix != "" {
			sec.Errorf("pki", "a projection has prefix or [pki], not both")
		}
		req := decodePKI(sec.Table("pki"))
		if m.Immutable {
			sec.Errorf("pki", "mount %s is immutable: it is read once, and its certificate would expire without being issued again", m.Name)
		}
		out = req.String()
	} else {
		switch err := checkPath(prefix); {
		case prefix == "":
			sec.Errorf("", "prefix is missing: a path in Vault, such as \"secret/app/\" (every secret below it) or \"secret/app/db\" (one secret), or a [pki] table")
		case err != nil:
			sec.Errorf("prefix", "%q: %v", prefix, err)
		}
		out = strings.TrimPrefix(prefix, "/")
	}
	if !sec.Has("pki") && m.DefaultMode&0o004 != 0 {
		sec.Warnf("prefix", "mount %s's files are readable by every user (default_mode %04o), and this projection's are secrets: set default_mode = \"0600\", or \"0640\" with group", m.Name, m.DefaultMode.Perm())
	}
	if m.Medium != config.MediumTmpfs {
		key := "prefix"
		if sec.Has("pki") {
			key = "pki"
		}
		sec.Warnf(key, "mount %s is on disk (medium %q): the secrets this projection reads would be written to the disk, and stay in its blocks and backups; use medium = \"tmpfs\"", m.Name, m.Medium)
	}
	return out
}

// checkPath returns why p is not a path a projection can read.
func checkPath(p string) error {
	trimmed := strings.TrimSuffix(strings.TrimPrefix(p, "/"), "/")
	switch {
	case strings.ContainsAny(p, "?#"):
		return fmt.Errorf("a path may not hold %q or %q", "?", "#")
	case trimmed == "":
		return fmt.Errorf("names no path")
	}
	for _, seg := range strings.Split(trimmed, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return fmt.Errorf("has an empty, \".\" or \"..\" element")
		}
	}
	return nil
}

// HoldsSecret reports whether the projection of prefix holds the secret a
// template names with path and params (config.SecretHolder): a PKI
// projection holds its role's issue path, with parameters that are its
// own; a path projection holds every secret below it (or itself), by its
// own path and, for KV v2, by its API path with "data/" after the engine's
// mount ("secret/data/app/db" for "secret/app/db"), whichever element of
// the prefix the mount ends at.
func (c *Config) HoldsSecret(prefix, p string, params []string) bool {
	p = strings.Trim(p, "/")
	if req, ok := parsePKIRequest(prefix); ok {
		if p != req.role {
			return false
		}
		for _, kv := range params {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || req.param(k) != v {
				return false
			}
		}
		return true
	}
	if len(params) > 0 {
		return false
	}
	if pathHolds(prefix, p) {
		return true
	}
	// KV v2's API path: "data/" after the mount, which ends at one of the
	// prefix's elements.
	for i := 1; i < len(prefix); i++ {
		if prefix[i-1] == '/' && pathHolds(prefix[:i]+"data/"+prefix[i:], p) {
			return true
		}
	}
	return false
}

// pathHolds reports whether the projection of prefix holds the secret at
// p: p is the prefix itself (without its trailing "/"), or lies below a
// prefix that ends in "/".
func pathHolds(prefix, p string) bool {
	if p == strings.TrimSuffix(prefix, "/") {
		return true
	}
	return strings.HasSuffix(prefix, "/") && strings.HasPrefix(p, prefix) && len(p) > len(prefix)
}

func open(name string, settings any, env source.Env) (source.Source, error) {
	c, ok := settings.(*Config)
	if !ok {
		return nil, fmt.Errorf("source/vault: settings are %T, not *vault.Config", settings)
	}
	s, err := New(name, c, env.Log)
	if err == nil && env.Files != nil {
		s.session.files = env.Files
	}
	return s, err
}

// Source reads one Vault server for every projection of its mounts.
type Source struct {
	name      string
	cfg       *Config
	log       *slog.Logger
	client    *api.Client
	transport *http.Transport
	session   *session
	// retries paces every retry after a failure, of every follow, the
	// login and the renewals alike (retryDelay).
	retries *rate.Limiter
}

// Bounds of a source's retries: whatever Vault answers, and however many
// projections fail at once, a source retries at most retryRate times a
// second (after a burst of retryBurst), each follow with its own jittered
// backoff from source.RetryMin up to retryCap.
const (
	retryRate  = rate.Limit(2)
	retryBurst = 4
	// maxHeaderWait bounds the wait for an answer to begin, within the
	// source's timeout (transport): Vault computes an answer before it
	// sends it, so a node that holds a request this long is taken for
	// frozen.
	maxHeaderWait = 3 * time.Second
)

// retryCap returns the longest wait between two attempts of a failing
// follow or login: the poll interval, within [source.RetryMin,
// source.RetryMax] — so that once Vault answers again, every projection
// is read within about two poll intervals.
func (s *Source) retryCap() time.Duration {
	return min(max(s.cfg.PollInterval, source.RetryMin), source.RetryMax)
}

// retryDelay returns how long to wait before a retry its caller's backoff
// puts at d: d, or longer when the source's retries are over retryRate.
func (s *Source) retryDelay(d time.Duration) time.Duration {
	return max(d, s.retries.Reserve().Delay())
}

// newRetryBackoff returns source.NewBackoff with its delays capped at
// limit.
func newRetryBackoff(limit time.Duration) *backoff.ExponentialBackOff {
	b := source.NewBackoff()
	b.MaxInterval = limit
	b.Reset()
	return b
}

var _ source.Source = (*Source)(nil)

// New returns a Source for cfg. It sends nothing until the first Follow.
// Its API client is made from cfg alone: VAULT_ADDR, VAULT_TOKEN,
// VAULT_NAMESPACE, VAULT_HEADERS and the other variables the client reads
// from the environment are overridden, so that the daemon's reads do not
// change with the environment it was started in.
func New(name string, cfg *Config, log *slog.Logger) (*Source, error) {
	rt := http.DefaultTransport.(*http.Transport).Clone()
	if cfg.TLS.Enabled() {
		tc, err := cfg.TLS.Config()
		if err != nil {
			return nil, fmt.Errorf("source/vault: %w", err)
		}
		rt.TLSClientConfig = tc
	}
	httpClient := &http.Client{
		// transport refuses redirects (a standby node's 307 to the
		// active one) and drops the connection of a failed answer.
		Transport:     transport{next: rt, limit: cfg.MaxResponseSize, headerWait: min(cfg.Timeout, maxHeaderWait)},
		Timeout:       cfg.Timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	client, err := api.NewClient(&api.Config{
		Address:    cfg.Address,
		HttpClient: httpClient,
		Timeout:    cfg.Timeout,
		// kvmount retries with its own backoff, reporting each failure.
		MaxRetries:       0,
		DisableRedirects: true,
	})
	if err != nil {
		return nil, fmt.Errorf("source/vault: %w", err)
	}
	client.SetMaxRetries(0)
	client.SetToken("")
	headers := http.Header{}
	headers.Set(api.RequestHeaderName, "true")
	client.SetHeaders(headers)
	if cfg.Namespace != "" {
		client.SetNamespace(cfg.Namespace)
	} else {
		client.ClearNamespace()
	}
	s := &Source{name: name, cfg: cfg, log: log, client: client, transport: rt,
		retries: rate.NewLimiter(retryRate, retryBurst)}
	s.session = newSession(cfg, client, log, s.retryCap(), s.retryDelay)
	return s, nil
}

// Close releases idle connections. No Follow may be running.
func (s *Source) Close() error {
	s.transport.CloseIdleConnections()
	return nil
}

// Follow reads the projection prefix names — a path or a PKI issue request
// (DecodeProjection) — and follows it until ctx is done; see
// source.Source. When ctx ends with the cause source.ErrReleased, the
// follow's leases are revoked (unless revoke_on_remove is false).
func (s *Source) Follow(ctx context.Context, prefix string, pub source.Publisher) error {
	defer s.session.join()()
	if req, ok := parsePKIRequest(prefix); ok {
		return s.followPKI(ctx, req, pub)
	}
	return s.followPath(ctx, strings.TrimPrefix(prefix, "/"), pub)
}

// revokeTimeout bounds the revocation of a follow's leases at its end.
const revokeTimeout = 10 * time.Second

// release revokes leaseID when ctx ended because no mount follows the
// projection any more and the configuration revokes then; what the
// projection is, is for the log.
func (s *Source) release(ctx context.Context, leaseID, what string) {
	if leaseID == "" || !s.cfg.RevokeOnRemove || !releasedCause(ctx) {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), revokeTimeout)
	defer cancel()
	if err := s.client.Sys().RevokeWithContext(rctx, leaseID); err != nil {
		s.log.Warn("could not revoke the lease of a projection no mount follows any more; it ends at its TTL", "projection", what, "lease", leaseID, "err", describe(err))
		return
	}
	s.log.Info("revoked the lease of a projection no mount follows any more", "projection", what, "lease", leaseID)
}

// releasedCause reports whether ctx ended because no mount follows the
// projection any more.
func releasedCause(ctx context.Context) bool {
	return errors.Is(context.Cause(ctx), source.ErrReleased)
}

// join joins a secret path's elements with "/", dropping empty ones; it
// does not clean them (a secret's name is the store's, read as it is).
func join(elems ...string) string {
	parts := make([]string, 0, len(elems))
	for _, e := range elems {
		if e = strings.Trim(e, "/"); e != "" {
			parts = append(parts, e)
		}
	}
	return strings.Join(parts, "/")
}
