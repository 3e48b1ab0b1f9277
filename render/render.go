// Package render is kvmount's template engine: Go's text/template over one
// mount's keys, with consul-template's function set — its names and
// semantics, for everything not tied to Consul's catalog or Vault
// (consul-template's docs/templating-language.md defines them; these are
// kvmount's own implementations) — and sprig's functions as
// sprig_<name>, as consul-template offers them.
//
// A render is hermetic: no environment, clock, randomness, file or network
// reaches it, so the same keys always render the same bytes; a function
// that would read one is refused when the template is parsed, at its line.
// And a render is bounded: it stops with an error once it runs longer than
// its time limit, once a function returns a value over its size limit or
// the values it produced pass their total, and once it writes more than
// its output limit — wherever it is, loops included (see bounds.go).
package render

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/template"
	"text/template/parse"
	"time"
)

// ErrTemplate marks every error of a template: a missing key it reads, a
// function's error, output over the limit, a render over its time or
// memory.
var ErrTemplate = errors.New("template")

// ErrRefused is wrapped by the parse error of a template that calls a
// function kvmount refuses: one that reads the clock, randomness, the
// environment, files or the network.
var ErrRefused = errors.New("refused")

// executions counts Execute calls, for the tests of Cache.
var executions atomic.Int64

// DefaultTimeout bounds one render when Limits.Timeout is zero.
const DefaultTimeout = 5 * time.Second

// Limits bound one render.
type Limits struct {
	// MaxOutput is the most bytes the render may write; 0 for no limit.
	MaxOutput int64
	// Timeout is how long the render may run; 0 means DefaultTimeout.
	Timeout time.Duration
}

// Template is a parsed template. Renders of one Template run one at a
// time (Execute holds its lock); different Templates render in parallel.
type Template struct {
	name string

	mu   sync.Mutex
	tmpl *template.Template
	st   *state
	// secretCalls are the template's calls of secret, for kvmount check.
	secretCalls []SecretCall
}

// Parse parses text as the template named name (its file, or
// "FILE:LINE" for inline text; it appears in errors with the line). Its
// errors are text/template's ("template: NAME:LINE: ..."), with a hint for
// a function kvmount does not have under that name (sprig's bare names:
// "did you mean toUpper, or sprig_upper?"), and one wrapping ErrRefused at
// the line of a refused function or of a key with a consul-template
// datacenter suffix ("x@dc1").
func Parse(name, text string) (*Template, error) {
	t := &Template{name: name, st: &state{}}
	tmpl, err := template.New(name).Option("missingkey=error").Funcs(parseFuncs).Parse(text)
	if err != nil {
		return nil, hint(err)
	}
	used := map[string]bool{}
	for _, tt := range tmpl.Templates() {
		if tt.Tree == nil {
			continue
		}
		if err := inspect(tt.Tree, used, &t.secretCalls); err != nil {
			return nil, err
		}
		addTicks(tt.Tree)
	}
	t.tmpl = tmpl.Funcs(t.st.funcs(t, used))
	return t, nil
}

// Execute renders t over keys within lim and returns the output and the
// paths it read (a listing as "dir/"). Errors wrap ErrTemplate and name
// the template; a key that does not exist names the key, and a key that
// was rejected says why.
func (t *Template) Execute(keys *Keys, lim Limits) ([]byte, map[string]bool, error) {
	executions.Add(1)
	t.mu.Lock()
	defer t.mu.Unlock()
	st := t.st
	st.reset(keys, lim)
	defer st.reset(nil, Limits{})
	w := &limitWriter{st: st, limit: lim.MaxOutput}
	err := execute(t.tmpl, w)
	read := st.read
	switch {
	case st.stop != nil:
		return nil, nil, fmt.Errorf("%w %s: %w", ErrTemplate, t.name, st.stop)
	case err != nil:
		return nil, nil, fmt.Errorf("%w %s: %w", ErrTemplate, t.name, err)
	}
	return w.buf.Bytes(), read, nil
}

// execute runs tmpl into w, turning a stop that text/template did not
// recover into an error.
func execute(tmpl *template.Template, w *limitWriter) (err error) {
	defer func() {
		if r := recover(); r != nil {
			sr, ok := r.(stopRender)
			if !ok {
				panic(r)
			}
			err = sr.err
		}
	}()
	return tmpl.Execute(w, nil)
}

// limitWriter is the render's output, stopping it once more than limit
// bytes are written (limit ≤ 0: no limit).
type limitWriter struct {
	st    *state
	buf   bytes.Buffer
	limit int64
}

// ErrOutputTooLarge is wrapped by the error of a render whose output
// passes Limits.MaxOutput.
var ErrOutputTooLarge = errors.New("output too large")

func (w *limitWriter) Write(p []byte) (int, error) {
	if w.limit > 0 && int64(w.buf.Len()+len(p)) > w.limit {
		return 0, w.st.stopWith(fmt.Errorf("%w: more than %d bytes", ErrOutputTooLarge, w.limit))
	}
	if err := w.st.expired(); err != nil {
		return 0, err
	}
	return w.buf.Write(p)
}

// inspect walks a parsed template: it records the functions it calls in
// used and its calls of secret in calls, and returns an error wrapping
// ErrRefused at the first refused function or key name with a datacenter
// suffix.
func inspect(tree *parse.Tree, used map[string]bool, calls *[]SecretCall) error {
	var err error
	var walk func(n parse.Node)
	walk = func(n parse.Node) {
		if err != nil || n == nil {
			return
		}
		switch n := n.(type) {
		case *parse.ListNode:
			if n == nil {
				return
			}
			for _, c := range n.Nodes {
				walk(c)
			}
		case *parse.ActionNode:
			walk(n.Pipe)
		case *parse.PipeNode:
			if n == nil {
				return
			}
			for _, c := range n.Cmds {
				walk(c)
			}
		case *parse.IdentifierNode:
			used[n.Ident] = true
			if why, refused := refusedFuncs[n.Ident]; refused {
				loc, _ := tree.ErrorContext(n)
				err = fmt.Errorf("template: %s: function %q is %w: %s; a template renders the same bytes for the same keys", loc, n.Ident, ErrRefused, why)
			}
		case *parse.CommandNode:
			for i, a := range n.Args {
				if id, ok := a.(*parse.IdentifierNode); ok {
					if secretFuncs[id.Ident] {
						*calls = append(*calls, secretCall(tree, n.Args, i))
					}
					if keyFuncs[id.Ident] {
						for _, arg := range n.Args[i+1:] {
							if s, ok := arg.(*parse.StringNode); ok && strings.Contains(s.Text, "@") {
								loc, _ := tree.ErrorContext(s)
								err = fmt.Errorf("template: %s: %s %q: %w: %s", loc, id.Ident, s.Text, ErrRefused, datacenterHint)
								return
							}
						}
					}
				}
				walk(a)
			}
		case *parse.IfNode:
			walk(n.Pipe)
			walk(n.List)
			walk(n.ElseList)
		case *parse.RangeNode:
			walk(n.Pipe)
			walk(n.List)
			walk(n.ElseList)
		case *parse.WithNode:
			walk(n.Pipe)
			walk(n.List)
			walk(n.ElseList)
		case *parse.TemplateNode:
			walk(n.Pipe)
		case *parse.ChainNode:
			walk(n.Node)
		}
	}
	walk(tree.Root)
	return err
}

// datacenterHint says how kvmount reads another datacenter.
const datacenterHint = "a consul-template datacenter suffix; kvmount reads one source per projection: follow the other datacenter with a source of its own (type = \"consul\", datacenter = \"dc1\")"

// hint adds to text/template's `function "X" not defined` what X is called
// here, when it is a sprig function or has a consul-template name.
func hint(err error) error {
	msg := err.Error()
	const pre, post = `function "`, `" not defined`
	i := strings.Index(msg, pre)
	if i < 0 || !strings.HasSuffix(msg, post) {
		return err
	}
	name := msg[i+len(pre) : len(msg)-len(post)]
	var alts []string
	if ct := ctNames[name]; ct != "" {
		alts = append(alts, ct)
	}
	if _, ok := sprigFuncs[name]; ok {
		alts = append(alts, "sprig_"+name)
	}
	if len(alts) == 0 {
		return err
	}
	return fmt.Errorf("%w (kvmount has consul-template's functions, and sprig's as sprig_NAME: did you mean %s?)", err, strings.Join(alts, ", or "))
}

// Names returns every function a template may call, sorted: consul-template's
// helpers, the key functions and sprig_<name>; refused ones excluded.
func Names() []string {
	var out []string
	for name := range parseFuncs {
		if _, refused := refusedFuncs[name]; !refused && name != tickName {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// Refused returns the functions a template may not call, with why.
func Refused() map[string]string { return maps.Clone(refusedFuncs) }
