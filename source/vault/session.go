package vault

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/source"
)

// session is a source's authentication: the token its requests carry, which
// one loop — running while any Follow does — obtains (token_file, an
// AppRole login), renews at two thirds of its TTL while it can (a
// renewal), and replaces when it cannot be renewed any more, when it is
// close to its maximum TTL, or when a request finds it revoked (check).
// Failures back off as every source's do, paced by the source's retries.
type session struct {
	cfg *Config
	// files is where the token and AppRole files are read at each login:
	// the disk, or in a worker the monitor that reads them (privsep).
	files  config.Files
	client *api.Client
	log    *slog.Logger
	fanout *source.Fanout
	// retryCap and retryDelay are the source's (Source.retryCap,
	// Source.retryDelay).
	retryCap   time.Duration
	retryDelay func(time.Duration) time.Duration

	// kick asks the loop to replace the token now; it holds one request.
	kick chan struct{}

	mu sync.Mutex
	// token is the current token, "" before the first login and after a
	// failed one.
	token string
	// generation increases with every new token: a lease read under one
	// token ends with it, so what holds one is read again.
	generation uint64
	// err is the last login's failure, nil once one succeeds.
	err error
	// changed is closed, and replaced, at every change of token or err.
	changed chan struct{}
}

func newSession(cfg *Config, client *api.Client, log *slog.Logger, retryCap time.Duration, retryDelay func(time.Duration) time.Duration) *session {
	s := &session{cfg: cfg, files: config.Disk{}, client: client, log: log, retryCap: retryCap, retryDelay: retryDelay,
		kick: make(chan struct{}, 1), changed: make(chan struct{})}
	s.fanout = source.NewFanout(s.loop)
	return s
}

// join registers a Follow, starting the loop for the first one; the
// function it returns unregisters it, stopping the loop after the last.
func (s *session) join() (leave func()) {
	f := s.fanout.Join("")
	return func() { s.fanout.Leave(f) }
}

// state returns the current generation (0 while there is no token), a
// channel closed at the next change, and the last login's failure.
func (s *session) state() (generation uint64, changed <-chan struct{}, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.token == "" {
		return 0, s.changed, s.err
	}
	return s.generation, s.changed, nil
}

// ready waits until the session has a token, and returns its generation;
// when a login failed and no token is left, it returns the failure at once
// (a follow reports it, and waits for the session's next change).
func (s *session) ready(ctx context.Context) (uint64, error) {
	for {
		gen, changed, err := s.state()
		switch {
		case gen > 0:
			return gen, nil
		case err != nil:
			return 0, err
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-changed:
		}
	}
}

// changes returns a channel closed at the session's next change.
func (s *session) changes() <-chan struct{} {
	_, changed, _ := s.state()
	return changed
}

// set records a new token (a new generation) or a failure to get one.
func (s *session) set(token string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.token, s.err = token, err
	if token != "" {
		s.generation++
	}
	s.client.SetToken(token)
	close(s.changed)
	s.changed = make(chan struct{})
}

// errTokenRevoked wraps the error of a request whose token turned out to be
// revoked or expired.
var errTokenRevoked = errors.New("the token was revoked or has expired; logging in again")

// check returns err, the failure of a request made under generation gen,
// as the follow reports it. A 403 may be a policy's refusal or a token
// that is no longer valid: check asks Vault about the token itself
// (lookup-self), and when it is not valid, asks the loop for a new one and
// returns an error wrapping errTokenRevoked.
func (s *session) check(ctx context.Context, gen uint64, err error) error {
	if statusOf(err) != http.StatusForbidden {
		return err
	}
	if cur, _, _ := s.state(); cur != gen {
		return fmt.Errorf("%w (%w)", errTokenRevoked, err) // replaced meanwhile
	}
	if !s.revoked(ctx) {
		return err
	}
	select {
	case s.kick <- struct{}{}:
	default:
	}
	return fmt.Errorf("%w (%w)", errTokenRevoked, err)
}

// loop keeps a token until ctx is done.
func (s *session) loop(ctx context.Context) {
	bo := newRetryBackoff(s.retryCap)
	for {
		sent := time.Now()
		auth, err := s.login(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			s.set("", err)
			wait := s.retryDelay(bo.NextBackOff())
			s.log.Warn("vault login failed", "method", s.method(), "err", err, "retry_in", wait)
			if !source.Sleep(ctx, wait) {
				return
			}
			continue
		}
		bo.Reset()
		s.set(auth.ClientToken, nil)
		s.log.Info("logged in to vault", "method", s.method(), "ttl_seconds", auth.LeaseDuration, "renewable", auth.Renewable)
		why := s.keep(ctx, auth, sent)
		if ctx.Err() != nil {
			return
		}
		s.log.Info("replacing the vault token", "method", s.method(), "why", why)
	}
}

// method names how the session logs in, for the log.
func (s *session) method() string {
	if s.cfg.AppRole != nil {
		return "approle"
	}
	return "token_file"
}

// keep renews auth's token, granted at start, on the schedule of a
// renewal (at two thirds of its TTL; failures retried with backoff
// capped by the time it has left) until it is to be replaced — it is not
// renewable, close to its maximum TTL, refused, or about to expire while
// renewals fail — a request found it revoked, or ctx is done; it returns
// why it stopped. A token without a TTL (a root token) is kept until a
// request finds it revoked.
func (s *session) keep(ctx context.Context, auth *api.SecretAuth, start time.Time) string {
	if auth.LeaseDuration <= 0 {
		select {
		case <-ctx.Done():
			return "stopping"
		case <-s.kick:
			return "a request found the token revoked"
		}
	}
	r := newRenewal(start, time.Duration(auth.LeaseDuration)*time.Second, auth.Renewable, s.retryCap, s.retryDelay)
	for {
		at, replace := r.next()
		timer := time.NewTimer(time.Until(at))
		select {
		case <-ctx.Done():
			timer.Stop()
			return "stopping"
		case <-s.kick:
			timer.Stop()
			return "a request found the token revoked"
		case <-timer.C:
		}
		if replace {
			if r.refused {
				return s.whyRefused(ctx)
			}
			return r.why()
		}
		sent := time.Now()
		limit := r.attemptLimit(sent)
		rctx, cancel := context.WithTimeout(ctx, limit)
		secret, err := s.client.Auth().Token().RenewSelfWithContext(rctx, int(r.increment/time.Second))
		if ctx.Err() != nil {
			cancel()
			return "stopping"
		}
		if err == nil && (secret == nil || secret.Auth == nil) {
			err = errors.New("the renewal's answer holds no token")
		}
		if err != nil {
			err = attemptFailure(err, rctx, limit)
			cancel()
			if wait := r.failed(time.Now(), err); wait > 0 {
				s.log.Warn("could not renew the vault token; retrying", "err", err, "retry_in", wait.Round(time.Millisecond),
					"expires_in", time.Until(r.expires()).Round(time.Second))
			}
			continue
		}
		cancel()
		r.renewed(sent, time.Duration(secret.Auth.LeaseDuration)*time.Second, secret.Auth.Renewable)
		s.log.Debug("renewed the vault token", "ttl_seconds", secret.Auth.LeaseDuration)
	}
}

// whyRefused says why Vault refused to renew the token (403): the token
// was revoked, which a lookup of it tells (it is refused too), or it may
// not renew itself (a policy without auth/token/renew-self).
func (s *session) whyRefused(ctx context.Context) string {
	if s.revoked(ctx) {
		return "the token was revoked (Vault refused its renewal)"
	}
	return "Vault refused its renewal (403) though the token is valid: its policies may not allow auth/token/renew-self"
}

// revoked reports whether Vault refuses the session's token itself: its
// lookup-self answers 403 (Vault's token/lookup-self endpoint, which every
// valid token may call). Any other outcome, a network failure included,
// counts as not revoked.
func (s *session) revoked(ctx context.Context) bool {
	_, err := s.client.Auth().Token().LookupSelfWithContext(ctx)
	return statusOf(err) == http.StatusForbidden
}

// login obtains a token: the one token_file holds, looked up for its TTL,
// or one from an AppRole login.
func (s *session) login(ctx context.Context) (*api.SecretAuth, error) {
	c, err := s.client.CloneWithHeaders()
	if err != nil {
		return nil, fmt.Errorf("source/vault: %w", err)
	}
	c.SetToken("")
	if a := s.cfg.AppRole; a != nil {
		roleID, err := config.ReadSecretFileFrom(s.files, a.RoleIDFile)
		if err != nil {
			return nil, fmt.Errorf("approle role_id_file: %w", err)
		}
		secretID, err := config.ReadSecretFileFrom(s.files, a.SecretIDFile)
		if err != nil {
			return nil, fmt.Errorf("approle secret_id_file: %w", err)
		}
		p := join("auth", a.Mount, "login")
		secret, err := c.Logical().WriteWithContext(ctx, p, map[string]any{"role_id": roleID.Reveal(), "secret_id": secretID.Reveal()})
		if err != nil {
			return nil, fmt.Errorf("approle login at %s: %w", p, describe(err))
		}
		if secret == nil || secret.Auth == nil || secret.Auth.ClientToken == "" {
			return nil, fmt.Errorf("approle login at %s: the response holds no token", p)
		}
		return secret.Auth, nil
	}
	token, err := config.ReadSecretFileFrom(s.files, s.cfg.TokenFile)
	if err != nil {
		return nil, fmt.Errorf("token_file: %w", err)
	}
	c.SetToken(token.Reveal())
	secret, err := c.Auth().Token().LookupSelfWithContext(ctx)
	if err != nil {
		if statusOf(err) == http.StatusForbidden {
			return nil, fmt.Errorf("the token in %s is not valid (revoked or expired); waiting for a new one there: %w", s.cfg.TokenFile, describe(err))
		}
		return nil, fmt.Errorf("looking up the token in %s: %w", s.cfg.TokenFile, describe(err))
	}
	auth := &api.SecretAuth{ClientToken: token.Reveal()}
	if secret != nil {
		if ttl, ok := secret.Data["ttl"].(json.Number); ok {
			n, _ := ttl.Int64()
			auth.LeaseDuration = int(n)
		}
		auth.Renewable, _ = secret.Data["renewable"].(bool)
	}
	return auth, nil
}
