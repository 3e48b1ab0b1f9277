package render

import (
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"
)

// Keys is what a template reads: one mount's keys by their path in the
// mount (the key minus its prefix, or an item's path), with the full key
// each came from, the folder markers (keys ending in "/", such as Consul's
// folders, which are never files) and the keys rejected, with why.
type Keys struct {
	// values and folders hold strings, made once: every call of key
	// returns the same string, never a copy.
	values   map[string]string
	full     map[string]string
	folders  map[string]string
	rejected map[string]string
	sorted   []string // values' paths, sorted, once listed
	// secrets are what the secret function reads (AddSecrets).
	secrets Secrets
}

// NewKeys returns an empty key view.
func NewKeys() *Keys {
	return &Keys{values: map[string]string{}, full: map[string]string{}, folders: map[string]string{}, rejected: map[string]string{}}
}

// Add makes value the key at path (clean, relative), which came from the
// store's key full.
func (k *Keys) Add(path, full string, value []byte) {
	k.values[path], k.full[path] = string(value), full
	k.sorted = nil
}

// AddFolder records a folder marker: dir ends in "/" (a path in the mount,
// or "" for the prefix itself), full is its key.
func (k *Keys) AddFolder(dir, full string, value []byte) {
	k.folders[dir] = string(value)
	k.full[dir] = full
}

// Reject records that the key at path was not projected, and why (it lies
// below another key, its path is invalid, ...): a template that reads it
// is told so, not that it does not exist.
func (k *Keys) Reject(path, why string) { k.rejected[path] = why }

// KV is one key as ls and tree return it, as consul-template's KeyPair:
// Key relative to the folder listed, Value its value, Path the full key in
// the store.
type KV struct {
	Key, Value, Path string
}

// String returns the value, so that {{ . }} of a KV prints it.
func (kv KV) String() string { return kv.Value }

// keyFuncs names the functions that read keys (their results are the
// mount's own data, not measured against MaxValue).
var keyFuncs = map[string]bool{"key": true, "keyOrDefault": true, "keyExists": true, "ls": true, "tree": true, "safeLs": true, "safeTree": true}

// keyFuncs returns the functions that read st's keys, as consul-template
// defines them, with kvmount's deliberate differences: a missing key is
// an error (consul-template waits for it), and ls and tree list a folder
// ("dir" is "dir/"), not every key that starts with the same bytes.
func (st *state) keyFuncs() map[string]any {
	return map[string]any{
		"key": func(p string) (string, error) {
			v, ok, err := st.lookup(p)
			if err == nil && !ok {
				err = st.missing(p)
			}
			return v, err
		},
		"keyOrDefault": func(p, def string) (string, error) {
			v, ok, err := st.lookup(p)
			if err != nil || !ok || v == "" {
				return def, err
			}
			return v, nil
		},
		"keyExists": func(p string) (bool, error) {
			_, ok, err := st.lookup(p)
			return ok, err
		},
		"ls":       func(dir string) ([]KV, error) { return st.list("ls", dir, false, false) },
		"tree":     func(dir string) ([]KV, error) { return st.list("tree", dir, true, false) },
		"safeLs":   func(dir string) ([]KV, error) { return st.list("safeLs", dir, false, true) },
		"safeTree": func(dir string) ([]KV, error) { return st.list("safeTree", dir, true, true) },
	}
}

// cleanKey cleans a path a template names ("./a", "a//b", "/a"; "" for
// the mount itself); folder reports a trailing "/" (a folder marker).
func cleanKey(p string) (clean string, folder bool) {
	folder = strings.HasSuffix(p, "/") && p != "/"
	clean = path.Clean(strings.TrimPrefix(p, "/"))
	if clean == "." {
		clean = ""
	}
	return clean, folder
}

// lookup returns the value of the key at p, or of the folder marker at p
// when p ends in "/", and records that it was read.
func (st *state) lookup(p string) (string, bool, error) {
	if err := noDatacenter(p); err != nil {
		return "", false, err
	}
	clean, folder := cleanKey(p)
	if folder {
		dir := clean + "/"
		if clean == "" {
			dir = ""
		}
		st.read[dir+"\x00folder"] = true
		v, ok := st.keys.folders[dir]
		return v, ok, nil
	}
	st.read[clean] = true
	v, ok := st.keys.values[clean]
	return v, ok, nil
}

// missing is the error of key for a path that has no key: rejected, with
// why, or absent.
func (st *state) missing(p string) error {
	clean, _ := cleanKey(p)
	if why, ok := st.keys.rejected[clean]; ok {
		return fmt.Errorf("key %q was rejected, not projected: %s", clean, why)
	}
	return fmt.Errorf("key %q does not exist", clean)
}

// noDatacenter refuses consul-template's "KEY@DATACENTER".
func noDatacenter(p string) error {
	if strings.Contains(p, "@") {
		return fmt.Errorf("key %q: %s", p, datacenterHint)
	}
	return nil
}

// list returns the keys below dir, sorted: its direct children, or every
// key below it with recursive. With safe, an empty list is an error (the
// mount keeps its last content), as consul-template's safeLs and safeTree
// refuse to render.
func (st *state) list(fn, dir string, recursive, safe bool) ([]KV, error) {
	if err := noDatacenter(dir); err != nil {
		return nil, err
	}
	clean, _ := cleanKey(dir)
	prefix := ""
	if clean != "" {
		prefix = clean + "/"
	}
	st.read[prefix] = true
	k := st.keys
	if k.sorted == nil {
		k.sorted = slices.Sorted(maps.Keys(k.values))
	}
	out := []KV{}
	start, _ := slices.BinarySearch(k.sorted, prefix)
	for _, p := range k.sorted[start:] {
		rel, ok := strings.CutPrefix(p, prefix)
		if !ok {
			break
		}
		if rel == "" || !recursive && strings.Contains(rel, "/") {
			continue
		}
		out = append(out, KV{Key: rel, Value: k.values[p], Path: k.full[p]})
	}
	if safe && len(out) == 0 {
		return nil, fmt.Errorf("%s %q: no keys below it; the template is not rendered (the mount keeps its last content)", fn, clean)
	}
	return out, nil
}
