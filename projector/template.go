package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/kvmount/kvmount/render"
)

// ErrTemplate marks an error of a template: a missing key it reads, a
// function's error, output over the size limit, a render over its time or
// memory (render.ErrTemplate).
var ErrTemplate = render.ErrTemplate

// RenderTimeout bounds one render: a runaway loop is stopped with an error.
const RenderTimeout = 5 * time.Second

// Template is a parsed [[mount.templates]] entry: a file rendered from the
// mount's keys, by their path in the mount, with consul-template's
// function set (package render).
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
	tmpl   *render.Template
}

// ParseTemplate parses text as the template for path, with origin naming
// it in errors. Its errors are render.Parse's, which name origin and the
// line ("template: nginx.conf.tmpl:3: function \"env\" is refused: ...").
func ParseTemplate(origin, path, text string, mode fs.FileMode) (*Template, error) {
	clean, err := CleanPath(path)
	if err != nil {
		return nil, err
	}
	t, err := render.Parse(origin, text)
	if err != nil {
		return nil, err
	}
	return &Template{Path: clean, Mode: mode, Origin: origin, tmpl: t}, nil
}

// SecretCalls returns the template's calls of secret, with their paths
// and parameters when they are string literals (render.Template.SecretCalls),
// for kvmount check.
func (t *Template) SecretCalls() []render.SecretCall { return t.tmpl.SecretCalls() }

// RenderCache lets a template none of whose inputs changed since its last
// render reuse its output (render.Cache). The zero value is ready; it is
// not safe for concurrent use (one populator owns it).
type RenderCache = render.Cache

// render renders t over keys with at most maxSize bytes of output (0: no
// limit), through cache when it is not nil. Output over maxSize is an
// error wrapping ErrValueTooLarge.
func (t *Template) render(cache *RenderCache, keys *render.Keys, maxSize int64) ([]byte, error) {
	out, err := cache.Render(t.tmpl, keys, render.Limits{MaxOutput: maxSize, Timeout: RenderTimeout})
	if errors.Is(err, render.ErrOutputTooLarge) {
		return nil, fmt.Errorf("%w %s: output exceeds %w (%d bytes)", ErrTemplate, t.Origin, ErrValueTooLarge, maxSize)
	}
	return out, err
}

// Render renders t over keys (paths in the mount → values) with at most
// maxSize bytes of output, for tests and tools: see render.Template.Execute.
func (t *Template) Render(keys map[string][]byte, maxSize int64) ([]byte, map[string]bool, error) {
	view := render.NewKeys()
	for p, v := range keys {
		view.Add(p, p, v)
	}
	out, read, err := t.tmpl.Execute(view, render.Limits{MaxOutput: maxSize, Timeout: RenderTimeout})
	if errors.Is(err, render.ErrOutputTooLarge) {
		return nil, nil, fmt.Errorf("%w %s: output exceeds %w (%d bytes)", ErrTemplate, t.Origin, ErrValueTooLarge, maxSize)
	}
	return out, read, err
}
