package render

import (
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"strings"
	"text/template"
	"text/template/parse"
	"time"
)

// How a render is bounded. text/template has no context to cancel and no
// hook per loop, so the bounds are put where a render must pass:
//
//   - every function a template calls is wrapped (reflect.MakeFunc, same
//     signature, so text/template converts arguments as before): the
//     wrapper stops the render past its deadline, refuses arguments that
//     would make a function build a huge value (repeat's count, a
//     printf width), and measures what the function returns — a value
//     over MaxValue, or values adding up to more than MaxProduced, stop
//     the render;
//   - a call to a hidden tick function is put at the start of every range
//     body and every template body, so that a loop that calls nothing (a
//     range over a range of a variable) or a recursive template still
//     meets the deadline;
//   - the output is written through a limit (Limits.MaxOutput).
//
// A stop is a panic inside a function, which text/template turns into the
// render's error (safeCall); Execute reports the stop's own error.

// Bounds of the values functions make in one render.
const (
	// MaxValue is the largest string (bytes) or collection (elements) one
	// function may return, outside the key functions, whose results are
	// the mount's own data.
	MaxValue = 16 << 20
	// MaxProduced is the most bytes the values of one render's functions
	// may add up to (a collection counts 16 bytes an element).
	MaxProduced = 256 << 20
	// maxWidth is the widest printf field.
	maxWidth = 1 << 16
)

// ErrBudget is wrapped by the error of a render that ran out of time or
// memory (Limits.Timeout, MaxValue, MaxProduced).
var ErrBudget = errors.New("render stopped")

// tickName is the hidden function put in every loop and template body.
const tickName = "_kvmount_tick"

// state is one Template's render in progress.
type state struct {
	keys     *Keys
	read     map[string]bool
	deadline time.Time
	produced int64
	scratch  *Scratch
	// stop is the error that stopped the render, if one did.
	stop error
	// ticks counts the calls of tick.
	ticks uint64
}

// reset readies st for a render over keys within lim.
func (st *state) reset(keys *Keys, lim Limits) {
	timeout := lim.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	*st = state{keys: keys, read: map[string]bool{}, deadline: time.Now().Add(timeout), scratch: &Scratch{}}
}

// stopRender is what a bound panics with.
type stopRender struct{ err error }

func (s stopRender) Error() string { return s.err.Error() }

// stopWith records err as what stopped the render (the first one stays)
// and returns it.
func (st *state) stopWith(err error) error {
	if st.stop == nil {
		st.stop = err
	}
	return st.stop
}

// fail stops the render with err, from inside a function call (text/template
// turns the panic into the call's error).
func (st *state) fail(err error) { panic(stopRender{st.stopWith(err)}) }

// expired returns the error that stopped the render, or the render's own
// once it is past its deadline.
func (st *state) expired() error {
	if st.stop != nil {
		return st.stop
	}
	if time.Now().After(st.deadline) {
		return st.stopWith(fmt.Errorf("%w: still running after its time limit (a runaway loop?)", ErrBudget))
	}
	return nil
}

// tick is what every loop round and template body calls: it stops the
// render once it is past its deadline, and every yieldEvery rounds gives
// the CPU to other goroutines (runtime.Gosched), so that renders running
// into their time limit on every CPU never starve the rest of the daemon —
// the reconciler's loop, the sources' watches, other mounts' writes.
func (st *state) tick() {
	st.ticks++
	if st.ticks%yieldEvery == 0 {
		runtime.Gosched()
	}
	st.check()
}

// yieldEvery is how many ticks a render runs between two yields.
const yieldEvery = 256

// check stops the render, from inside a function call, once it is past its
// deadline or was stopped.
func (st *state) check() {
	if err := st.expired(); err != nil {
		panic(stopRender{err})
	}
}

// account measures a function's result.
func (st *state) account(name string, v reflect.Value) {
	n, size := measure(v)
	if n > MaxValue {
		st.fail(fmt.Errorf("%w: %s returned a value of %d %s, more than %d", ErrBudget, name, n, unit(v), MaxValue))
	}
	st.produced += size
	if st.produced > MaxProduced {
		st.fail(fmt.Errorf("%w: its functions made more than %d bytes of values", ErrBudget, MaxProduced))
	}
}

// measure returns the length of v (bytes of a string, elements of a
// collection) and the bytes it is counted for.
func measure(v reflect.Value) (n, size int64) {
	for v.IsValid() && (v.Kind() == reflect.Interface || v.Kind() == reflect.Pointer) {
		if v.IsNil() {
			return 0, 0
		}
		v = v.Elem()
	}
	switch v.Kind() {
	case reflect.String:
		return int64(v.Len()), int64(v.Len())
	case reflect.Slice, reflect.Array, reflect.Map:
		if v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Uint8 {
			return int64(v.Len()), int64(v.Len())
		}
		return int64(v.Len()), 16 * int64(v.Len())
	}
	return 0, 8
}

func unit(v reflect.Value) string {
	for v.IsValid() && (v.Kind() == reflect.Interface || v.Kind() == reflect.Pointer) && !v.IsNil() {
		v = v.Elem()
	}
	if v.Kind() == reflect.String || v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Uint8 {
		return "bytes"
	}
	return "elements"
}

var errorType = reflect.TypeFor[error]()

// wrap returns fn with the same signature, bounded: the deadline checked,
// pre checked against the arguments (nil for none), the results measured
// unless trusted (the key functions' results are the mount's own data).
func (st *state) wrap(name string, fn any, pre func(args []reflect.Value) error, trusted bool) any {
	fv := reflect.ValueOf(fn)
	ft := fv.Type()
	return reflect.MakeFunc(ft, func(args []reflect.Value) []reflect.Value {
		st.check()
		if pre != nil {
			if err := pre(args); err != nil {
				st.fail(fmt.Errorf("%w: %s: %w", ErrBudget, name, err))
			}
		}
		var out []reflect.Value
		if ft.IsVariadic() {
			out = fv.CallSlice(args)
		} else {
			out = fv.Call(args)
		}
		if !trusted && len(out) > 0 && (len(out) == 1 || out[1].IsNil()) && ft.Out(0) != errorType {
			st.account(name, out[0])
		}
		st.check()
		return out
	}).Interface()
}

// funcs returns the functions of t's template — only those it uses, each
// wrapped — bound to st; parse-time placeholders stay for the others.
func (st *state) funcs(t *Template, used map[string]bool) template.FuncMap {
	all := map[string]any{}
	for name, fn := range helperFuncs() {
		all[name] = fn
	}
	for name, fn := range sprigFuncs {
		all["sprig_"+name] = fn
	}
	for name, fn := range st.keyFuncs() {
		all[name] = fn
	}
	all["secret"] = st.secretFunc
	all["executeTemplate"] = func(name string, data ...any) (string, error) {
		var dot any
		switch len(data) {
		case 0:
		case 1:
			dot = data[0]
		default:
			return "", fmt.Errorf("executeTemplate: wrong number of arguments, expected 1 or 2, but got %d", len(data)+1)
		}
		var b strings.Builder
		if err := t.tmpl.ExecuteTemplate(&b, name, dot); err != nil {
			return "", err
		}
		return b.String(), nil
	}
	all["scratch"] = func() *Scratch { return st.scratch }
	for name, fn := range printFuncs {
		all[name] = fn
	}
	out := template.FuncMap{tickName: func() string { st.tick(); return "" }}
	for name := range used {
		fn, ok := all[name]
		if !ok {
			continue // a builtin such as len or index
		}
		trusted := keyFuncs[name] || secretFuncs[name]
		out[name] = st.wrap(name, fn, preChecks[name], trusted)
	}
	return out
}

// addTicks puts a call of the tick function at the start of every range
// body and of the template's own body.
func addTicks(tree *parse.Tree) {
	tick := func(pos parse.Pos, line int) parse.Node {
		id := parse.NewIdentifier(tickName).SetPos(pos)
		return &parse.ActionNode{NodeType: parse.NodeAction, Pos: pos, Line: line,
			Pipe: &parse.PipeNode{NodeType: parse.NodePipe, Pos: pos, Line: line,
				Cmds: []*parse.CommandNode{{NodeType: parse.NodeCommand, Pos: pos, Args: []parse.Node{id}}}}}
	}
	var walk func(n parse.Node)
	walk = func(n parse.Node) {
		switch n := n.(type) {
		case *parse.ListNode:
			if n == nil {
				return
			}
			for _, c := range n.Nodes {
				walk(c)
			}
		case *parse.IfNode:
			walk(n.List)
			walk(n.ElseList)
		case *parse.WithNode:
			walk(n.List)
			walk(n.ElseList)
		case *parse.RangeNode:
			walk(n.List)
			walk(n.ElseList)
			if n.List != nil {
				n.List.Nodes = append([]parse.Node{tick(n.Position(), n.Line)}, n.List.Nodes...)
			}
		}
	}
	walk(tree.Root)
	if tree.Root != nil {
		tree.Root.Nodes = append([]parse.Node{tick(tree.Root.Position(), 1)}, tree.Root.Nodes...)
	}
}
