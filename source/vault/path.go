package vault

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/vault/api"

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

	// The lease of a secret of another engine, and its renewal.
	leaseID  string
	leaseGen uint64
	watcher  *api.LifetimeWatcher
	// rereadIn, when positive, is when a secret read under a lease that
	// cannot be renewed is read again.
	rereadIn time.Duration
}

// followPath follows the path projection p until ctx is done. A KV path
// is polled every poll_interval; a path of another engine (a dynamic
// secret) is read again when its lease cannot be renewed any more, is
// close to its maximum TTL, or ended with the session's token — or every
// poll_interval when it has no lease.
func (s *Source) followPath(ctx context.Context, p string, pub source.Publisher) error {
	f := &pathFollow{s: s, path: p, pub: pub}
	defer f.stop(ctx)
	bo := source.NewBackoff()
	for {
		gen, err := s.session.ready(ctx)
		if err == nil {
			if err = f.pass(ctx, gen); err != nil {
				err = s.session.check(ctx, gen, err)
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		var next <-chan time.Time
		switch {
		case gen == 0 && err != nil:
			// No token: the session retries, and says when it has one.
			pub.Status(fmt.Errorf("source/vault: %w", err))
		case err != nil:
			wait := bo.NextBackOff()
			s.log.Warn("source unavailable, keeping last content", "path", p, "err", err, "retry_in", wait)
			pub.Status(fmt.Errorf("source/vault: %s: %w", p, err))
			next = time.After(wait)
		default:
			bo.Reset()
			pub.Status(nil)
			next = f.next()
		}
		if !f.wait(ctx, next, gen == 0) {
			return ctx.Err()
		}
	}
}

// next returns when the follow reads again after a successful pass: never
// by the clock while a renewable lease is kept (its watcher says when), at
// two thirds of a lease that cannot be renewed, else every poll interval.
func (f *pathFollow) next() <-chan time.Time {
	switch {
	case f.watcher != nil:
		return nil
	case f.rereadIn > 0:
		return time.After(f.rereadIn)
	}
	return time.After(source.Jitter(f.s.cfg.PollInterval))
}

// wait waits for next, for the session's next change when noToken, for
// the lease's watcher to end, or for a new token when a lease is kept; it
// returns false once ctx is done.
func (f *pathFollow) wait(ctx context.Context, next <-chan time.Time, noToken bool) bool {
	for {
		var changed <-chan struct{}
		if noToken || f.leaseID != "" {
			changed = f.s.session.changes()
			if cur, _, _ := f.s.session.state(); noToken && cur != 0 || f.leaseID != "" && cur != 0 && cur != f.leaseGen {
				return true
			}
		}
		var done <-chan error
		var renewed <-chan *api.RenewOutput
		if f.watcher != nil {
			done, renewed = f.watcher.DoneCh(), f.watcher.RenewCh()
		}
		select {
		case <-ctx.Done():
			return false
		case <-next:
			return true
		case <-changed:
		case r := <-renewed:
			if r != nil && r.Secret != nil {
				f.s.log.Debug("renewed a lease", "path", f.path, "lease", f.leaseID, "ttl_seconds", r.Secret.LeaseDuration)
			}
		case err := <-done:
			why := "it cannot be renewed beyond its maximum TTL"
			if err != nil {
				why = fmt.Sprintf("renewing it failed: %v", describe(err))
			}
			f.s.log.Info("reading a leased secret again", "path", f.path, "lease", f.leaseID, "why", why)
			f.watcher.Stop()
			f.watcher = nil
			return true
		}
	}
}

// stop ends the follow: it stops the lease's renewal, and revokes the
// lease when no mount follows the projection any more.
func (f *pathFollow) stop(ctx context.Context) {
	if f.watcher != nil {
		f.watcher.Stop()
	}
	f.s.release(ctx, f.leaseID, f.path)
}

// pass reads the projection once and publishes what changed; gen is the
// generation of the session's token.
func (f *pathFollow) pass(ctx context.Context, gen uint64) error {
	eng, err := f.s.engineOf(ctx, f.path)
	if err != nil {
		return err
	}
	switch eng.kind {
	case engineKV2, engineKV1:
		return f.passKV(ctx, eng)
	}
	return f.readOther(ctx, gen)
}

// readOther reads the path of an engine other than KV — a dynamic secret
// such as database/creds/app — and publishes its fields. A lease that can
// be renewed is renewed at two thirds of its duration by a watcher, which
// ends close to the lease's maximum TTL (the next read follows); one that
// cannot is read again at two thirds of its duration. The previous lease
// is left to its TTL: a service may still hold what it gave.
func (f *pathFollow) readOther(ctx context.Context, gen uint64) error {
	secret, err := f.s.client.Logical().ReadWithContext(ctx, f.path)
	if err != nil {
		return fmt.Errorf("reading %s: %w", f.path, describe(err))
	}
	if f.watcher != nil {
		f.watcher.Stop()
		f.watcher = nil
	}
	f.leaseID, f.leaseGen, f.rereadIn = "", 0, 0
	if secret == nil || secret.Data == nil {
		f.publishOther(nil, nil)
		return nil
	}
	f.publishOther(secret, secret.Data)
	if secret.LeaseID == "" {
		return nil
	}
	f.leaseID, f.leaseGen = secret.LeaseID, gen
	duration := time.Duration(secret.LeaseDuration) * time.Second
	if !secret.Renewable {
		f.rereadIn = max(duration*2/3, minReissue)
		return nil
	}
	w, err := f.s.client.NewLifetimeWatcher(&api.LifetimeWatcherInput{Secret: secret})
	if err != nil {
		f.rereadIn = max(duration*2/3, minReissue)
		return nil
	}
	f.watcher = w
	go w.Start()
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
	f.pub.Publish(source.Snapshot{Revision: fingerprint, Missing: secret == nil, Entries: entries, Oversized: oversized, Secrets: secrets})
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
