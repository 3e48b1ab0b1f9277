package vault

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/render"
	"github.com/kvmount/kvmount/source"
)

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
		Entries:   kvset.FromMap(entries),
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
