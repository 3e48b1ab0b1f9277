package projector

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path"
	"slices"
	"strings"
	"sync/atomic"
	"text/template"
	"time"

	"github.com/Masterminds/sprig/v3"
)

// ErrTemplate marks an error of a template: a missing key it reads, a
// function's error, output over the size limit, a render over the time
// limit.
var ErrTemplate = errors.New("template")

// renders counts Render calls, for tests of RenderCache.
var renders atomic.Int64

// RenderTimeout bounds one render: a runaway range is stopped with an
// error (its goroutine is abandoned until it ends by itself).
const RenderTimeout = 5 * time.Second

// Template is a parsed [[mount.templates]] entry: a Go text/template whose
// functions read the mount's keys by their path in the mount.
type Template struct {
	// Path is where the rendered file lands, relative to the mount
	// (cleaned, see CleanPath).
	Path string
	// Mode is the rendered file's permission; zero means the mount's
	// default_mode.
	Mode fs.FileMode
	// Origin names the template in errors: its file, or "config:LINE" for
	// inline text.
	Origin string
	tmpl   *template.Template
}

// KV is one key as ls and tree return it: Key relative to the directory
// listed, Value the key's value.
type KV struct {
	Key   string
	Value string
}

// keyView is what a template reads: the mount's keys by path, and the
// paths it read, so that a render can be skipped when none of them
// changed.
type keyView struct {
	keys map[string][]byte
	read map[string]bool // paths read, and "dir/" for listings
}

// funcs returns the template functions bound to v: kvmount's key functions
// over sprig's hermetic map (no environment, clock, randomness or network,
// so the same keys always render the same bytes).
func (v *keyView) funcs() template.FuncMap {
	fm := sprig.HermeticTxtFuncMap()
	fm["key"] = func(p string) (string, error) {
		p = cleanKeyPath(p)
		v.read[p] = true
		value, ok := v.keys[p]
		if !ok {
			return "", fmt.Errorf("key %q does not exist", p)
		}
		return string(value), nil
	}
	fm["keyOrDefault"] = func(p, def string) string {
		p = cleanKeyPath(p)
		v.read[p] = true
		if value, ok := v.keys[p]; ok {
			return string(value)
		}
		return def
	}
	fm["keyExists"] = func(p string) bool {
		p = cleanKeyPath(p)
		v.read[p] = true
		_, ok := v.keys[p]
		return ok
	}
	fm["ls"] = func(dir string) []KV { return v.list(dir, false) }
	fm["tree"] = func(dir string) []KV { return v.list(dir, true) }
	return fm
}

// placeholderFuncs are the key functions for parsing only.
func placeholderFuncs() template.FuncMap {
	v := &keyView{keys: map[string][]byte{}, read: map[string]bool{}}
	return v.funcs()
}

// cleanKeyPath cleans a path a template names ("./a", "a//b").
func cleanKeyPath(p string) string {
	p = path.Clean(strings.TrimPrefix(p, "/"))
	if p == "." {
		return ""
	}
	return p
}

// list returns the keys below dir, sorted: its direct children only, or
// every key below it with recursive.
func (v *keyView) list(dir string, recursive bool) []KV {
	dir = cleanKeyPath(dir)
	prefix := ""
	if dir != "" {
		prefix = dir + "/"
	}
	v.read[prefix] = true
	var out []KV
	for _, p := range slices.Sorted(maps.Keys(v.keys)) {
		rel, ok := strings.CutPrefix(p, prefix)
		if !ok || rel == "" || !recursive && strings.Contains(rel, "/") {
			continue
		}
		out = append(out, KV{Key: rel, Value: string(v.keys[p])})
	}
	return out
}

// ParseTemplate parses text as the template for path, with origin naming
// it in errors. Its error is text/template's, naming origin and the line
// ("template: nginx.conf.tmpl:3: function \"env\" not defined").
func ParseTemplate(origin, path, text string, mode fs.FileMode) (*Template, error) {
	clean, err := CleanPath(path)
	if err != nil {
		return nil, err
	}
	t, err := template.New(origin).Option("missingkey=error").Funcs(placeholderFuncs()).Parse(text)
	if err != nil {
		return nil, err
	}
	return &Template{Path: clean, Mode: mode, Origin: origin, tmpl: t}, nil
}

// limitWriter fails once more than limit bytes are written (limit ≤ 0: no
// limit).
type limitWriter struct {
	buf   bytes.Buffer
	limit int64
}

var errTooLong = errors.New("output too large")

func (w *limitWriter) Write(p []byte) (int, error) {
	if w.limit > 0 && int64(w.buf.Len()+len(p)) > w.limit {
		return 0, errTooLong
	}
	return w.buf.Write(p)
}

// Render executes t over keys (paths in the mount → values) and returns
// the output and the paths it read ("dir/" for a listing). The output is
// at most maxSize bytes (0: no limit); a render that runs longer than
// RenderTimeout is abandoned. Errors wrap ErrTemplate and name the
// template and, for a missing key, the key.
func (t *Template) Render(keys map[string][]byte, maxSize int64) ([]byte, map[string]bool, error) {
	renders.Add(1)
	v := &keyView{keys: keys, read: map[string]bool{}}
	tmpl, err := t.tmpl.Clone()
	if err != nil {
		return nil, nil, fmt.Errorf("%w %s: %w", ErrTemplate, t.Origin, err)
	}
	tmpl.Funcs(v.funcs())
	w := &limitWriter{limit: maxSize}
	done := make(chan error, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- fmt.Errorf("panic: %v", r)
			}
		}()
		done <- tmpl.Execute(w, nil)
	}()
	timer := time.NewTimer(RenderTimeout)
	defer timer.Stop()
	select {
	case err = <-done:
	case <-timer.C:
		return nil, nil, fmt.Errorf("%w %s: render still running after %v (a runaway range?)", ErrTemplate, t.Origin, RenderTimeout)
	}
	if errors.Is(err, errTooLong) {
		return nil, nil, fmt.Errorf("%w %s: output exceeds %w (%d bytes)", ErrTemplate, t.Origin, ErrValueTooLarge, maxSize)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("%w %s: %w", ErrTemplate, t.Origin, err)
	}
	return w.buf.Bytes(), v.read, nil
}

// RenderCache remembers, per template, what its last render read and
// produced, so that a template none of whose inputs changed is not
// rendered again (its output is reused). The zero value is ready; a
// RenderCache is not safe for concurrent use (one populator owns it).
type RenderCache struct {
	entries map[*Template]*cachedRender
}

type cachedRender struct {
	read map[string]bool
	// seen holds, per path read, its value ("\x00" when missing), and per
	// listing ("dir/"), every key below it with its value.
	seen map[string]string
	out  []byte
}

// signature returns what a template saw of p in keys: a value, or for a
// listing ("dir/") every key below it with its value.
func signature(keys map[string][]byte, p string) string {
	if !strings.HasSuffix(p, "/") && p != "" {
		if v, ok := keys[p]; ok {
			return string(v)
		}
		return "\x00"
	}
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(keys)) {
		if strings.HasPrefix(k, p) {
			b.WriteString(k)
			b.WriteByte(0)
			b.Write(keys[k])
			b.WriteByte(0)
		}
	}
	return b.String()
}

// render renders t over keys, reusing the cached output when nothing t
// read last time changed. A nil cache always renders.
func (c *RenderCache) render(t *Template, keys map[string][]byte, maxSize int64) ([]byte, error) {
	if c != nil {
		if e := c.entries[t]; e != nil {
			same := true
			for p := range e.read {
				if signature(keys, p) != e.seen[p] {
					same = false
					break
				}
			}
			if same {
				return e.out, nil
			}
		}
	}
	out, read, err := t.Render(keys, maxSize)
	if err != nil || c == nil {
		return out, err
	}
	if c.entries == nil {
		c.entries = map[*Template]*cachedRender{}
	}
	e := &cachedRender{read: read, seen: make(map[string]string, len(read)), out: out}
	for p := range read {
		e.seen[p] = signature(keys, p)
	}
	c.entries[t] = e
	return out, nil
}
