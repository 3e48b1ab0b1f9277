package render

import (
	"fmt"
	"reflect"
	"strings"
	"text/template"
	"unicode/utf8"
)

// Functions whose result can be far larger than their arguments, by a
// count, width or replacement that may come from a key: repeat 1000000000
// "x" once took the daemon down. Their arguments are checked before the
// call (preChecks), so that the value is never built; what the other
// functions return is measured after (state.account).

// preChecks are the argument checks of the functions that amplify, by
// name; each returns an error when the result would pass MaxValue.
var preChecks = map[string]func(args []reflect.Value) error{
	"sprig_repeat":                 func(a []reflect.Value) error { return product(count(a[0]), int64(len(str(a[1])))) },
	"sprig_until":                  func(a []reflect.Value) error { return atMost(count(a[0]), "numbers") },
	"sprig_untilStep":              func(a []reflect.Value) error { return steps(count(a[0]), count(a[1]), count(a[2])) },
	"sprig_seq":                    seqCheck,
	"indent":                       func(a []reflect.Value) error { return indentCheck(count(a[0]), str(a[1])) },
	"sprig_indent":                 func(a []reflect.Value) error { return indentCheck(count(a[0]), str(a[1])) },
	"sprig_nindent":                func(a []reflect.Value) error { return indentCheck(count(a[0]), str(a[1])) },
	"replaceAll":                   func(a []reflect.Value) error { return replaceCheck(str(a[0]), str(a[1]), str(a[2])) },
	"sprig_replace":                func(a []reflect.Value) error { return replaceCheck(str(a[0]), str(a[1]), str(a[2])) },
	"regexReplaceAll":              func(a []reflect.Value) error { return regexCheck(str(a[1]), str(a[2])) },
	"sprig_regexReplaceAll":        func(a []reflect.Value) error { return regexCheck(str(a[2]), str(a[1])) },
	"sprig_regexReplaceAllLiteral": func(a []reflect.Value) error { return regexCheck(str(a[2]), str(a[1])) },
	"sprig_wrapWith":               func(a []reflect.Value) error { return product(int64(len(str(a[2]))), int64(len(str(a[1])))+1) },
}

func init() {
	// Functions whose result is as large as their arguments, which may
	// be the same large value many times over (a list of references to
	// one string): the arguments' total is checked.
	for _, name := range []string{"print", "printf", "println", "html", "js", "urlquery", "join", "sprig_join", "sprig_cat",
		"toJSON", "toJSONPretty", "toUnescapedJSON", "toUnescapedJSONPretty", "toYAML", "toTOML",
		"sprig_toJson", "sprig_toPrettyJson", "sprig_toRawJson", "sprig_mustToJson", "sprig_mustToPrettyJson", "sprig_mustToRawJson",
		"sprig_toString", "sprig_toStrings", "sprig_quote", "sprig_squote"} {
		if preChecks[name] == nil {
			preChecks[name] = argsCheck
		}
	}
}

// count returns an integer argument (0 for anything else).
func count(v reflect.Value) int64 {
	for v.Kind() == reflect.Interface && !v.IsNil() {
		v = v.Elem()
	}
	switch {
	case isInt(v):
		return v.Int()
	case isUint(v):
		return int64(min(v.Uint(), 1<<62))
	case isFloat(v):
		return int64(v.Float())
	}
	return 0
}

// str returns a string argument ("" for anything else).
func str(v reflect.Value) string {
	for v.Kind() == reflect.Interface && !v.IsNil() {
		v = v.Elem()
	}
	if v.Kind() == reflect.String {
		return v.String()
	}
	return fmt.Sprint(v)
}

func atMost(n int64, what string) error {
	if n > MaxValue {
		return fmt.Errorf("%d %s is more than %d", n, what, MaxValue)
	}
	return nil
}

// product checks a result of n copies of size bytes.
func product(n, size int64) error {
	if n > 0 && size > 0 && n > MaxValue/size {
		return fmt.Errorf("would make %d × %d bytes, more than %d", n, size, MaxValue)
	}
	return nil
}

func steps(start, stop, step int64) error {
	if step == 0 {
		return nil
	}
	return atMost((stop-start)/step, "numbers")
}

// seqCheck bounds sprig's seq: seq 5, seq 1 5, seq 1 2 9.
func seqCheck(a []reflect.Value) error {
	var args []int64
	if len(a) == 1 && a[0].Kind() == reflect.Slice {
		for i := range a[0].Len() {
			args = append(args, count(a[0].Index(i)))
		}
	}
	switch len(args) {
	case 1:
		return atMost(max(args[0], -args[0]), "numbers")
	case 2:
		return atMost(max(args[1]-args[0], args[0]-args[1]), "numbers")
	case 3:
		if args[1] == 0 {
			return nil
		}
		return atMost(max((args[2]-args[0])/args[1], (args[0]-args[2])/args[1]), "numbers")
	}
	return nil
}

// indentCheck bounds an indent of s by spaces on every line.
func indentCheck(spaces int64, s string) error {
	if spaces > maxWidth {
		return fmt.Errorf("an indent of %d spaces is more than %d", spaces, maxWidth)
	}
	return product(int64(strings.Count(s, "\n")+1), spaces+1)
}

// replaceCheck bounds replacing every old in s with new.
func replaceCheck(old, new, s string) error {
	n := int64(strings.Count(s, old))
	if old == "" {
		n = int64(utf8.RuneCountInString(s) + 1)
	}
	if grow := int64(len(new) - len(old)); grow > 0 {
		return product(n, grow)
	}
	return nil
}

// regexCheck bounds a regular expression's replacement of s with repl,
// which an empty match puts between every two characters.
func regexCheck(repl, s string) error { return product(int64(len(s)+1), int64(len(repl))+1) }

// argsCheck bounds a function whose result is as large as all its
// arguments together, nested values included (deepSize).
func argsCheck(a []reflect.Value) error {
	var total int64
	for _, v := range a {
		total += deepSize(v, MaxValue-total+1)
		if total > MaxValue {
			return fmt.Errorf("its arguments hold more than %d bytes", MaxValue)
		}
	}
	return nil
}

// deepSize returns the bytes of the strings v holds, nested values
// included, counting each element of a collection at least 1 byte, and
// stops once past limit.
func deepSize(v reflect.Value, limit int64) int64 {
	var n int64
	var walk func(v reflect.Value, depth int)
	walk = func(v reflect.Value, depth int) {
		if n > limit || depth > 64 || !v.IsValid() {
			return
		}
		switch v.Kind() {
		case reflect.Interface, reflect.Pointer:
			if !v.IsNil() {
				walk(v.Elem(), depth+1)
			}
		case reflect.String:
			n += int64(v.Len())
		case reflect.Slice, reflect.Array:
			if v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Uint8 {
				n += int64(v.Len())
				return
			}
			for i := 0; i < v.Len() && n <= limit; i++ {
				n++
				walk(v.Index(i), depth+1)
			}
		case reflect.Map:
			it := v.MapRange()
			for it.Next() && n <= limit {
				n++
				walk(it.Key(), depth+1)
				walk(it.Value(), depth+1)
			}
		case reflect.Struct:
			for i := 0; i < v.NumField() && n <= limit; i++ {
				if v.Type().Field(i).IsExported() {
					walk(v.Field(i), depth+1)
				}
			}
		default:
			n += 8
		}
	}
	walk(v, 0)
	return n
}

// printFuncs are text/template's printing builtins, which a template may
// call with a width from a key (printf "%*d"): printf checks its widths
// and precisions first; all are bounded as the other functions are.
var printFuncs = map[string]any{
	"print":    fmt.Sprint,
	"println":  fmt.Sprintln,
	"printf":   printf,
	"html":     template.HTMLEscaper,
	"js":       template.JSEscaper,
	"urlquery": template.URLQueryEscaper,
}

// printf is fmt.Sprintf, refusing a width or precision over maxWidth,
// written in the format or given as an argument (*).
func printf(format string, args ...any) (string, error) {
	next := 0 // the argument the next * or verb takes
	for i := 0; i < len(format); i++ {
		if format[i] != '%' {
			continue
		}
		i++
		for i < len(format) && strings.IndexByte("+-# 0", format[i]) >= 0 {
			i++
		}
		for part := 0; part < 2 && i < len(format); part++ { // width, then precision
			if part == 1 {
				if format[i] != '.' {
					break
				}
				i++
			}
			if i < len(format) && format[i] == '[' { // an explicit argument index
				j := strings.IndexByte(format[i:], ']')
				if j < 0 {
					break
				}
				fmt.Sscanf(format[i+1:i+j], "%d", &next)
				next--
				i += j + 1
			}
			switch {
			case i < len(format) && format[i] == '*':
				if next >= 0 && next < len(args) {
					if w := count(reflect.ValueOf(args[next])); w > maxWidth || w < -maxWidth {
						return "", fmt.Errorf("printf: a width or precision of %d is more than %d", w, maxWidth)
					}
				}
				next++
				i++
			default:
				w := 0
				for i < len(format) && format[i] >= '0' && format[i] <= '9' {
					if w = w*10 + int(format[i]-'0'); w > maxWidth {
						return "", fmt.Errorf("printf: a width or precision over %d", maxWidth)
					}
					i++
				}
			}
		}
		if i < len(format) && format[i] == '[' {
			j := strings.IndexByte(format[i:], ']')
			if j > 0 {
				fmt.Sscanf(format[i+1:i+j], "%d", &next)
				next--
				i += j + 1
			}
		}
		if i < len(format) && format[i] != '%' {
			next++
		}
	}
	return fmt.Sprintf(format, args...), nil
}
