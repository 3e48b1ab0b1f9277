package vault

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/render"
	"github.com/kvmount/kvmount/source"
)

// Bounds of one pass over a KV prefix.
const (
	// readConcurrency is how many requests one pass has in flight.
	readConcurrency = 8
	// maxDepth is the deepest folder a pass lists below its prefix.
	maxDepth = 64
	// maxSecrets bounds the secrets of a prefix whose mounts set no bound
	// (items, templates only).
	maxSecrets = 100_000
)

// Kinds of secrets engine, as a path projection reads them.
const (
	engineKV2   = "kv v2"
	engineKV1   = "kv v1"
	engineOther = "other"
)

// engine is the secrets engine a projection's path lies in.
type engine struct {
	// mount is the engine's path, with a trailing "/" ("secret/").
	mount string
	// kind is engineKV2, engineKV1 or engineOther.
	kind string
}

// engineOf asks Vault which engine p lies in (sys/internal/ui/mounts/P,
// which any token that may read below p may ask).
func (s *Source) engineOf(ctx context.Context, p string) (engine, error) {
	secret, err := s.client.Logical().ReadWithContext(ctx, "sys/internal/ui/mounts/"+p)
	if err != nil {
		return engine{}, fmt.Errorf("looking up the secrets engine of %s: %w", p, describe(err))
	}
	if secret == nil || secret.Data == nil {
		return engine{}, fmt.Errorf("no secrets engine is mounted at %s", p)
	}
	mount, _ := secret.Data["path"].(string)
	typ, _ := secret.Data["type"].(string)
	if mount == "" || !strings.HasPrefix(p, mount) && p != strings.TrimSuffix(mount, "/") {
		return engine{}, fmt.Errorf("no secrets engine is mounted at %s", p)
	}
	version := ""
	if opts, ok := secret.Data["options"].(map[string]any); ok {
		version, _ = opts["version"].(string)
	}
	switch {
	case (typ == "kv" || typ == "generic") && version == "2":
		return engine{mount: mount, kind: engineKV2}, nil
	case typ == "kv" || typ == "generic":
		return engine{mount: mount, kind: engineKV1}, nil
	}
	return engine{mount: mount, kind: engineOther}, nil
}

// pathFollow is the state of one path projection's follow.
type pathFollow struct {
	s    *Source
	path string
	pub  source.Publisher

	// known are the KV secrets the last pass read, by their path in the
	// engine; what has not changed is not read again.
	known map[string]*kvSecret
	// eng and unreadable are the engine and the names that could not be
	// read of the last pass.
	eng        engine
	unreadable []string
	// fingerprint identifies what was last published.
	fingerprint string
	published   bool

	// attempted is the generation of the token the last pass ran under
	// (0: there was none); a newer one wakes a follow that failed or holds
	// a lease.
	attempted uint64
	// leaseID is the lease of the secret of another engine last read, and
	// renewal its schedule: renewed while it can be, read again before it
	// ends.
	leaseID string
	renewal *renewal
}

// followPath follows the path projection p until ctx is done. A KV path
// is polled every poll_interval; a path of another engine (a dynamic
// secret) is read again when its lease cannot be renewed any more, is
// close to its maximum TTL, or ended with the session's token — or every
// poll_interval when it has no lease. A failed pass is retried with the
// source's backoff (capped at retryCap, paced by retryDelay), or as soon
// as the session logs in with a new token.
func (s *Source) followPath(ctx context.Context, p string, pub source.Publisher) error {
	f := &pathFollow{s: s, path: p, pub: pub}
	defer f.stop(ctx)
	bo := newRetryBackoff(s.retryCap())
	for {
		gen, err := s.session.ready(ctx)
		if err == nil {
			if err = f.pass(ctx); err != nil {
				err = s.session.check(ctx, gen, err)
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		f.attempted = gen
		var next <-chan time.Time
		switch {
		case gen == 0 && err != nil:
			// No token: the session retries, and says when it has one.
			pub.Status(fmt.Errorf("source/vault: %w", err))
		case err != nil:
			wait := s.retryDelay(bo.NextBackOff())
			s.log.Warn("source unavailable, keeping last content", "path", p, "err", err, "retry_in", wait.Round(time.Millisecond))
			pub.Status(fmt.Errorf("source/vault: %s: %w", p, err))
			next = time.After(wait)
		default:
			bo.Reset()
			pub.Status(nil)
			if f.renewal == nil {
				next = time.After(source.Jitter(f.s.cfg.PollInterval))
			}
		}
		if !f.wait(ctx, next, err != nil) {
			return ctx.Err()
		}
	}
}

// wait waits for next; meanwhile it renews the lease the follow holds.
// It returns true for the next pass: at next, when the lease is to be
// replaced (unless the last pass failed: its retry waits for next), or —
// when the last pass failed or a lease is held — when the session has a
// token newer than the one the last pass ran under. It returns false once
// ctx is done.
func (f *pathFollow) wait(ctx context.Context, next <-chan time.Time, failed bool) bool {
	for {
		var changed <-chan struct{}
		if failed || f.leaseID != "" {
			changed = f.s.session.changes()
			if cur, _, _ := f.s.session.state(); cur != 0 && cur != f.attempted {
				return true
			}
		}
		var due <-chan time.Time
		var replace bool
		stop := func() bool { return false }
		if f.renewal != nil {
			var at time.Time
			at, replace = f.renewal.next()
			t := time.NewTimer(time.Until(at))
			due, stop = t.C, t.Stop
		}
		select {
		case <-ctx.Done():
			stop()
			return false
		case <-next:
			stop()
			return true
		case <-changed:
			stop()
		case <-due:
			if !replace {
				f.renew(ctx)
				continue
			}
			f.s.log.Info("reading a leased secret again", "path", f.path, "lease", f.leaseID, "why", f.renewal.why())
			f.renewal = nil
			if !failed {
				return true
			}
		}
	}
}

// renew renews the follow's lease once, and records the outcome in its
// renewal.
func (f *pathFollow) renew(ctx context.Context) {
	sent := time.Now()
	limit := f.renewal.attemptLimit(sent)
	rctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	secret, err := f.s.client.Sys().RenewWithContext(rctx, f.leaseID, int(f.renewal.increment/time.Second))
	if ctx.Err() != nil {
		return
	}
	if err == nil && secret == nil {
		err = errors.New("the renewal's answer holds no lease")
	}
	if err != nil {
		err = attemptFailure(err, rctx, limit)
		if wait := f.renewal.failed(time.Now(), err); wait > 0 {
			f.s.log.Warn("could not renew a lease; retrying", "path", f.path, "lease", f.leaseID, "err", err,
				"retry_in", wait.Round(time.Millisecond), "expires_in", time.Until(f.renewal.expires()).Round(time.Second))
		}
		return
	}
	f.renewal.renewed(sent, time.Duration(secret.LeaseDuration)*time.Second, secret.Renewable)
	f.s.log.Debug("renewed a lease", "path", f.path, "lease", f.leaseID, "ttl_seconds", secret.LeaseDuration)
}

// stop ends the follow: it revokes the lease when no mount follows the
// projection any more.
func (f *pathFollow) stop(ctx context.Context) {
	f.s.release(ctx, f.leaseID, f.path)
}

// pass reads the projection once and publishes what changed.
func (f *pathFollow) pass(ctx context.Context) error {
	eng, err := f.s.engineOf(ctx, f.path)
	if err != nil {
		return err
	}
	switch eng.kind {
	case engineKV2, engineKV1:
		return f.passKV(ctx, eng)
	}
	return f.readOther(ctx)
}

// readOther reads the path of an engine other than KV — a dynamic secret
// such as database/creds/app — and publishes its fields. Its lease is
// kept by a renewal: renewed at two thirds of its duration while it can
// be, and read again at two thirds of what is left once it cannot (not
// renewable, close to its maximum TTL, or renewals failing as its end
// nears). The previous lease is left to its TTL: a service may still hold
// what it gave.
func (f *pathFollow) readOther(ctx context.Context) error {
	sent := time.Now()
	secret, err := f.s.client.Logical().ReadWithContext(withPatience(ctx), f.path)
	if err != nil {
		return fmt.Errorf("reading %s: %w", f.path, describe(err))
	}
	f.leaseID, f.renewal = "", nil
	if secret == nil || secret.Data == nil {
		f.publishOther(nil, nil)
		return nil
	}
	f.publishOther(secret, secret.Data)
	if secret.LeaseID == "" {
		return nil
	}
	f.leaseID = secret.LeaseID
	duration := max(time.Duration(secret.LeaseDuration)*time.Second, minReissue*3/2)
	f.renewal = newRenewal(sent, duration, secret.Renewable, f.s.retryCap(), f.s.retryDelay)
	return nil
}

// publishOther publishes the secret another engine gave (nil: the path
// holds nothing), unless it is what was last published.
func (f *pathFollow) publishOther(secret *api.Secret, data map[string]any) {
	lim := f.pub.Limits()
	entries := map[string][]byte{}
	oversized := map[string]int64{}
	var secrets render.Secrets
	if secret != nil {
		kept := secretFiles(entries, oversized, "", data, data, false, lim)
		s := render.NewSecret(secret.LeaseID, secret.LeaseDuration, secret.Renewable, kept, nil)
		s.Warnings = secret.Warnings
		secrets = render.Secrets{f.path: s}
	}
	var lease []string
	if secret != nil {
		lease = append(lease, "lease "+secret.LeaseID)
	}
	fingerprint := fingerprintOf(entries, oversized, lease...)
	if f.published && fingerprint == f.fingerprint {
		return
	}
	f.published, f.fingerprint = true, fingerprint
	if len(oversized) == 0 {
		oversized = nil
	}
	f.pub.Publish(source.Snapshot{Revision: fingerprint, Missing: secret == nil, Entries: kvset.FromMap(entries), Oversized: oversized, Secrets: secrets})
}

// fingerprintOf returns a short digest of a snapshot's entries, oversized
// keys and extra lines (versions, a lease), in a fixed order: two equal
// fingerprints are one content.
func fingerprintOf(entries map[string][]byte, oversized map[string]int64, extra ...string) string {
	h := sha256.New()
	for _, k := range slices.Sorted(maps.Keys(entries)) {
		fmt.Fprintf(h, "%q=%q\n", k, entries[k])
	}
	for _, k := range slices.Sorted(maps.Keys(oversized)) {
		fmt.Fprintf(h, "%q:%d\n", k, oversized[k])
	}
	for _, line := range extra {
		fmt.Fprintln(h, line)
	}
	return hex.EncodeToString(h.Sum(nil))[:16]
}
