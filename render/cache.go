package render

import (
	"maps"
	"slices"
	"strings"
)

// Cache remembers, per template, what its last render read and produced,
// so that a template none of whose inputs changed is not rendered again
// (its output is reused). The zero value is ready; a Cache is not safe
// for concurrent use (one populator owns it).
type Cache struct {
	entries map[*Template]*cached
}

type cached struct {
	// seen holds, per path read, what the template saw (signature).
	seen map[string]string
	out  []byte
}

// Render renders t over keys within lim, or returns its last output when
// nothing it read then has changed. A nil Cache always renders.
func (c *Cache) Render(t *Template, keys *Keys, lim Limits) ([]byte, error) {
	if c != nil {
		if e := c.entries[t]; e != nil {
			same := true
			for p, seen := range e.seen {
				if signature(keys, p) != seen {
					same = false
					break
				}
			}
			if same {
				return e.out, nil
			}
		}
	}
	out, read, err := t.Execute(keys, lim)
	if err != nil || c == nil {
		return out, err
	}
	if c.entries == nil {
		c.entries = map[*Template]*cached{}
	}
	e := &cached{seen: make(map[string]string, len(read)), out: out}
	for p := range read {
		e.seen[p] = signature(keys, p)
	}
	c.entries[t] = e
	return out, nil
}

// Forget drops what the cache holds of templates not in keep.
func (c *Cache) Forget(keep []*Template) {
	for t := range c.entries {
		if !slices.Contains(keep, t) {
			delete(c.entries, t)
		}
	}
}

// signature returns what a template saw of p in keys: for a path, its
// value, full key or why it was rejected ("\x00" when missing); for a
// folder marker ("dir/\x00folder"), its value; for a listing ("dir/" or
// ""), every key below it with its full key and value; for a secret
// ("\x00secret:PATH"), its lease and data.
func signature(keys *Keys, p string) string {
	if path, ok := strings.CutPrefix(p, secretRead); ok {
		return secretSignature(keys, path)
	}
	if dir, ok := strings.CutSuffix(p, "\x00folder"); ok {
		if v, ok := keys.folders[dir]; ok {
			return "f" + v
		}
		return "\x00"
	}
	if p != "" && !strings.HasSuffix(p, "/") {
		if v, ok := keys.values[p]; ok {
			return "v" + keys.full[p] + "\x00" + v
		}
		if why, ok := keys.rejected[p]; ok {
			return "r" + why
		}
		return "\x00"
	}
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(keys.values)) {
		if strings.HasPrefix(k, p) {
			b.WriteString(k)
			b.WriteByte(0)
			b.WriteString(keys.full[k])
			b.WriteByte(0)
			b.WriteString(keys.values[k])
			b.WriteByte(0)
		}
	}
	return b.String()
}
