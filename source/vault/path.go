package vault

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hashicorp/vault/api"
	"golang.org/x/sync/errgroup"

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

// kvSecret is one KV secret as a pass read it.
type kvSecret struct {
	// version is a KV v2 secret's version; 0 for KV v1.
	version int64
	// lease is the response's lease duration, in seconds (KV v1's refresh
	// interval), and warnings its warnings, for templates.
	lease    int
	warnings []string
	// data is the response's data: {"data", "metadata"} for KV v2, the
	// fields for KV v1.
	data map[string]any
	// fields are the secret's fields.
	fields map[string]any
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

// passKV reads a KV projection: the one secret it names, or every secret
// below it. KV v2 secrets are read only when their current version changed
// since the last pass (the metadata endpoint tells), at that version, so
// that the snapshot is every secret at the version this pass saw; a
// current version deleted or destroyed is no secret. KV v1 has no
// metadata: every secret is read.
func (f *pathFollow) passKV(ctx context.Context, eng engine) error {
	rel := strings.TrimPrefix(f.path, eng.mount)
	if f.path == strings.TrimSuffix(eng.mount, "/") {
		rel = ""
	}
	folder := rel == "" || strings.HasSuffix(rel, "/")
	lim := f.pub.Limits()
	names := []string{rel}
	if folder {
		base := eng.mount
		if eng.kind == engineKV2 {
			base += "metadata/"
		}
		var err error
		if names, err = f.list(ctx, base, rel, lim); err != nil {
			return err
		}
	}
	reads := make([]*kvSecret, len(names))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(readConcurrency)
	for i, name := range names {
		if !readable(name) {
			continue
		}
		g.Go(func() error {
			var err error
			if eng.kind == engineKV2 {
				reads[i], err = f.readKV2(gctx, eng, name)
			} else {
				reads[i], err = f.readKV1(gctx, eng, name)
			}
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	known := make(map[string]*kvSecret, len(names))
	var unreadable []string
	for i, name := range names {
		switch {
		case !readable(name):
			unreadable = append(unreadable, name)
		case reads[i] != nil:
			known[name] = reads[i]
		}
	}
	if f.published && eng == f.eng && eng.kind == engineKV2 && slices.Equal(unreadable, f.unreadable) && maps.Equal(known, f.known) {
		return nil // every secret at the version last read: an idle poll
	}
	f.known, f.eng, f.unreadable = known, eng, unreadable
	return f.publishKV(eng, rel, folder, unreadable)
}

// readable reports whether a name a listing gave can be read: no empty,
// "." or ".." element, which would name another path (Vault cleans them
// away itself; a server that does not is not followed there).
func readable(name string) bool {
	return checkPath(name) == nil
}

// list returns the secrets below the folder rel of the engine path base
// ("secret/metadata/" for KV v2, "secret/" for v1), recursively, sorted, as
// paths in the engine: a folder at a time, each level's folders listed in
// parallel; more secrets than lim allows (else maxSecrets), or folders
// deeper than maxDepth, are an error.
func (f *pathFollow) list(ctx context.Context, base, rel string, lim source.Limits) ([]string, error) {
	most := lim.MaxKeys
	if most <= 0 {
		most = maxSecrets
	}
	var names []string
	level := []string{rel}
	for depth := 0; len(level) > 0; depth++ {
		if depth > maxDepth {
			return nil, fmt.Errorf("folders deeper than %d levels below %s", maxDepth, f.path)
		}
		keys := make([][]string, len(level))
		g, gctx := errgroup.WithContext(ctx)
		g.SetLimit(readConcurrency)
		for i, folder := range level {
			g.Go(func() error {
				secret, err := f.s.client.Logical().ListWithContext(gctx, base+folder)
				if err != nil {
					return fmt.Errorf("listing %s: %w", base+folder, describe(err))
				}
				if secret != nil {
					list, _ := secret.Data["keys"].([]any)
					for _, k := range list {
						if name, ok := k.(string); ok && name != "" {
							keys[i] = append(keys[i], name)
						}
					}
				}
				return nil
			})
		}
		if err := g.Wait(); err != nil {
			return nil, err
		}
		var next []string
		for i, folder := range level {
			for _, k := range keys[i] {
				if strings.HasSuffix(k, "/") {
					next = append(next, folder+k)
				} else {
					names = append(names, folder+k)
				}
			}
		}
		if len(names) > most || len(next) > most {
			return nil, fmt.Errorf("%s: more than %d secrets, more than its mounts may take (from max_files): %w", f.path, most, source.ErrOverLimits)
		}
		level = next
	}
	slices.Sort(names)
	return names, nil
}

// readKV2 reads the KV v2 secret name: its metadata, then — when its
// current version is not the one the last pass read — its data at that
// version. nil for a secret that does not exist, or whose current version
// is deleted or destroyed.
func (f *pathFollow) readKV2(ctx context.Context, eng engine, name string) (*kvSecret, error) {
	mp := eng.mount + "metadata/" + name
	md, err := f.s.client.Logical().ReadWithContext(ctx, mp)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", mp, describe(err))
	}
	if md == nil || md.Data == nil {
		return nil, nil
	}
	current := number(md.Data["current_version"])
	if current <= 0 {
		return nil, nil
	}
	versions, _ := md.Data["versions"].(map[string]any)
	v, _ := versions[strconv.FormatInt(current, 10)].(map[string]any)
	if destroyed, _ := v["destroyed"].(bool); destroyed {
		return nil, nil
	}
	if deleted, _ := v["deletion_time"].(string); deleted != "" {
		if t, err := time.Parse(time.RFC3339Nano, deleted); err != nil || !t.After(time.Now()) {
			return nil, nil
		}
	}
	if prev := f.known[name]; prev != nil && prev.version == current {
		return prev, nil
	}
	dp := eng.mount + "data/" + name
	d, err := f.s.client.Logical().ReadWithDataWithContext(ctx, dp, map[string][]string{"version": {strconv.FormatInt(current, 10)}})
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", dp, describe(err))
	}
	if d == nil || d.Data == nil {
		return nil, nil // deleted since the metadata was read
	}
	fields, ok := d.Data["data"].(map[string]any)
	if !ok {
		return nil, nil
	}
	return &kvSecret{version: current, lease: d.LeaseDuration, warnings: d.Warnings, data: d.Data, fields: fields}, nil
}

// readKV1 reads the KV v1 secret name; nil when it does not exist.
func (f *pathFollow) readKV1(ctx context.Context, eng engine, name string) (*kvSecret, error) {
	p := eng.mount + name
	d, err := f.s.client.Logical().ReadWithContext(ctx, p)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", p, describe(err))
	}
	if d == nil || d.Data == nil {
		return nil, nil
	}
	return &kvSecret{lease: d.LeaseDuration, warnings: d.Warnings, data: d.Data, fields: d.Data}, nil
}

// number returns a JSON number as an int64, 0 when it is not one.
func number(v any) int64 {
	switch n := v.(type) {
	case json.Number:
		i, _ := n.Int64()
		return i
	case float64:
		return int64(n)
	}
	return 0
}

// fieldValue returns a secret's field as a file holds it: a string as its
// bytes, anything else as its JSON.
func fieldValue(v any) []byte {
	if s, ok := v.(string); ok {
		return []byte(s)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return []byte(fmt.Sprint(v))
	}
	return b
}

// secretFiles returns the files of a secret's fields, by key (base, then
// the field's name), and what templates read of it: its data without the
// fields whose values lim does not keep, which go to oversized.
func secretFiles(entries map[string][]byte, oversized map[string]int64, base string, fields, data map[string]any, kv2 bool, lim source.Limits) map[string]any {
	var dropped []string
	for field, v := range fields {
		value := fieldValue(v)
		if !lim.Keeps(len(value)) {
			oversized[base+field] = int64(len(value))
			dropped = append(dropped, field)
			continue
		}
		entries[base+field] = value
	}
	if len(dropped) == 0 {
		return data
	}
	kept := maps.Clone(fields)
	for _, field := range dropped {
		delete(kept, field)
	}
	if !kv2 {
		return kept
	}
	out := maps.Clone(data)
	out["data"] = kept
	return out
}

// publishKV publishes the secrets the last pass read, when they differ
// from what was last published. A projection of a folder names each
// secret's files by its path below the folder; a projection of one secret
// by its fields alone. Names that cannot be read are published as keys of
// their own, empty, so that the projector rejects them by name.
func (f *pathFollow) publishKV(eng engine, rel string, folder bool, unreadable []string) error {
	kv2 := eng.kind == engineKV2
	lim := f.pub.Limits()
	entries := map[string][]byte{}
	oversized := map[string]int64{}
	secrets := render.Secrets{}
	for _, name := range slices.Sorted(maps.Keys(f.known)) {
		sec := f.known[name]
		base := ""
		if folder {
			base = strings.TrimPrefix(name, rel) + "/"
		}
		data := secretFiles(entries, oversized, base, sec.fields, sec.data, kv2, lim)
		tmpl := render.NewSecret("", sec.lease, false, data, nil)
		tmpl.Warnings = sec.warnings
		secrets[eng.mount+name] = tmpl
		if kv2 {
			secrets[eng.mount+"data/"+name] = tmpl
		}
	}
	for _, name := range unreadable {
		entries[strings.TrimPrefix(name, rel)] = nil
	}
	var versions []string
	for _, name := range slices.Sorted(maps.Keys(f.known)) {
		versions = append(versions, fmt.Sprintf("%q@%d", name, f.known[name].version))
	}
	fingerprint := fingerprintOf(entries, oversized, versions...)
	if f.published && fingerprint == f.fingerprint {
		return nil
	}
	f.published, f.fingerprint = true, fingerprint
	if len(oversized) == 0 {
		oversized = nil
	}
	f.pub.Publish(source.Snapshot{
		Revision:  revisionOf(eng, f.known, fingerprint),
		Missing:   len(f.known) == 0 && len(unreadable) == 0,
		Entries:   entries,
		Oversized: oversized,
		Secrets:   secrets,
	})
	return nil
}

// revisionOf names a KV snapshot for logs: for one KV v2 secret its
// version, else the snapshot's fingerprint.
func revisionOf(eng engine, known map[string]*kvSecret, fingerprint string) string {
	if eng.kind == engineKV2 && len(known) == 1 {
		for _, s := range known {
			return "v" + strconv.FormatInt(s.version, 10)
		}
	}
	return fingerprint
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
