package render

import (
	"bytes"
	"crypto/hmac"
	"crypto/md5"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"dario.cat/mergo"
	"github.com/BurntSushi/toml"
	"go.yaml.in/yaml/v2"
	"golang.org/x/text/cases"
	"golang.org/x/text/language"
)

// consul-template's helper functions (docs/templating-language.md,
// "Helper Functions" and "Math Functions"), with its names, argument
// orders (the piped value last: `"a,b" | split ","`, `5 | subtract 2` is
// 3) and results: kvmount's own implementations, checked against tables
// taken from those docs (funcs_test.go) and against consul-template itself
// (daemon's TestConsulTemplateParity).

// helperFuncs returns the helpers by name.
func helperFuncs() map[string]any {
	return map[string]any{
		"base64Decode":          base64Decode,
		"base64Encode":          base64Encode,
		"base64URLDecode":       base64URLDecode,
		"base64URLEncode":       base64URLEncode,
		"byKey":                 byKey,
		"contains":              contains,
		"containsAll":           containsSome(true, true),
		"containsAny":           containsSome(false, false),
		"containsNone":          containsSome(true, false),
		"containsNotAll":        containsSome(false, true),
		"explode":               explode,
		"explodeMap":            explodeMap,
		"mergeMap":              mergeMap,
		"mergeMapWithOverride":  mergeMapWithOverride,
		"in":                    in,
		"indent":                indent,
		"loop":                  loop,
		"join":                  join,
		"trim":                  func(cutset, s string) string { return strings.Trim(s, cutset) },
		"trimPrefix":            func(prefix, s string) string { return strings.TrimPrefix(s, prefix) },
		"trimSuffix":            func(suffix, s string) string { return strings.TrimSuffix(s, suffix) },
		"trimSpace":             strings.TrimSpace,
		"parseBool":             parseBool,
		"parseFloat":            parseFloat,
		"parseInt":              parseInt,
		"parseUint":             parseUint,
		"parseJSON":             parseJSON,
		"parseYAML":             parseYAML,
		"regexReplaceAll":       regexReplaceAll,
		"regexMatch":            regexMatch,
		"replaceAll":            func(from, to, s string) string { return strings.ReplaceAll(s, from, to) },
		"sha256Hex":             func(s string) string { sum := sha256.Sum256([]byte(s)); return hex.EncodeToString(sum[:]) },
		"md5sum":                func(s string) string { sum := md5.Sum([]byte(s)); return hex.EncodeToString(sum[:]) },
		"hmacSHA256Hex":         hmacSHA256Hex,
		"toLower":               strings.ToLower,
		"toUpper":               strings.ToUpper,
		"toTitle":               func(s string) string { return cases.Title(language.Und, cases.NoLower).String(s) },
		"toJSON":                toJSON,
		"toJSONPretty":          toJSONPretty,
		"toUnescapedJSON":       func(v any) (string, error) { return unescapedJSON(v, "") },
		"toUnescapedJSONPretty": func(v any) (string, error) { return unescapedJSON(v, "  ") },
		"toYAML":                toYAML,
		"toTOML":                toTOML,
		"split":                 split,
		"splitToMap":            splitToMap,
		"add":                   arith("add", func(a, b int64) int64 { return a + b }, func(a, b uint64) uint64 { return a + b }, func(a, b float64) float64 { return a + b }),
		"subtract":              arith("subtract", func(a, b int64) int64 { return a - b }, func(a, b uint64) uint64 { return a - b }, func(a, b float64) float64 { return a - b }),
		"multiply":              arith("multiply", func(a, b int64) int64 { return a * b }, func(a, b uint64) uint64 { return a * b }, func(a, b float64) float64 { return a * b }),
		"divide":                divide,
		"modulo":                modulo,
		"minimum":               extreme("minimum", -1),
		"maximum":               extreme("maximum", 1),
	}
}

func base64Decode(s string) (string, error) {
	v, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return "", fmt.Errorf("base64Decode: %w", err)
	}
	return string(v), nil
}

func base64Encode(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func base64URLDecode(s string) (string, error) {
	v, err := base64.URLEncoding.DecodeString(s)
	if err != nil {
		return "", fmt.Errorf("base64URLDecode: %w", err)
	}
	return string(v), nil
}

func base64URLEncode(s string) string { return base64.URLEncoding.EncodeToString([]byte(s)) }

// byKey groups the pairs of a tree by their first path element, which it
// strips from their Key; pairs with nothing after it are left out.
func byKey(pairs []KV) map[string]map[string]KV {
	m := map[string]map[string]KV{}
	for _, p := range pairs {
		top, rest, _ := strings.Cut(p.Key, "/")
		if rest == "" {
			continue
		}
		if m[top] == nil {
			m[top] = map[string]KV{}
		}
		p.Key = rest
		m[top][rest] = p
	}
	return m
}

// contains is in with its arguments swapped, for a pipe: l | contains v.
func contains(v, l any) bool { return in(l, v) }

// containsSome returns containsAll (true, true), containsAny (false,
// false), containsNone (true, false) and containsNotAll (false, true).
func containsSome(whenNone, invert bool) func([]any, any) bool {
	return func(needles []any, l any) bool {
		for _, n := range needles {
			if in(l, n) != invert {
				return !whenNone
			}
		}
		return whenNone
	}
}

// in reports whether v is an element of the list or array l (integers
// and floats compared by value, strings of the same type by content), or a
// substring of the string l.
func in(l, v any) bool {
	lv, vv := reflect.ValueOf(l), reflect.ValueOf(v)
	switch lv.Kind() {
	case reflect.Array, reflect.Slice:
		for i := range lv.Len() {
			e := lv.Index(i)
			for e.Kind() == reflect.Interface && !e.IsNil() {
				e = e.Elem()
			}
			switch {
			case isInt(e) && isInt(vv):
				if e.Int() == vv.Int() {
					return true
				}
			case isFloat(e) && isFloat(vv):
				if e.Float() == vv.Float() {
					return true
				}
			case e.Kind() == reflect.String && vv.IsValid() && e.Type() == vv.Type() && e.String() == vv.String():
				return true
			}
		}
	case reflect.String:
		return vv.IsValid() && vv.Type() == lv.Type() && strings.Contains(lv.String(), vv.String())
	}
	return false
}

func isInt(v reflect.Value) bool {
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return true
	}
	return false
}

func isUint(v reflect.Value) bool {
	switch v.Kind() {
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return true
	}
	return false
}

func isFloat(v reflect.Value) bool { return v.Kind() == reflect.Float32 || v.Kind() == reflect.Float64 }

// explode turns the pairs of a tree or ls into nested maps, one level per
// path element of their Key.
func explode(pairs []KV) (map[string]any, error) {
	m := map[string]any{}
	for _, p := range pairs {
		if err := explodeInto(m, p.Key, p.Value, p.Key); err != nil {
			return nil, fmt.Errorf("explode: %w", err)
		}
	}
	return m, nil
}

// explodeInto sets v at the path k below m, making the maps on the way.
func explodeInto(m map[string]any, k string, v any, whole string) error {
	top, rest, nested := strings.Cut(k, "/")
	if !nested {
		if k != "" {
			m[k] = v
		}
		return nil
	}
	if _, ok := m[top]; !ok {
		m[top] = map[string]any{}
	}
	sub, ok := m[top].(map[string]any)
	if !ok {
		return fmt.Errorf("not a map: %q: %q already has value %q", whole, top, m[top])
	}
	return explodeInto(sub, rest, v, k)
}

// explodeMap turns a flat map of "a/b" keys into nested maps, as explode.
func explodeMap(in map[string]any) (map[string]any, error) {
	out := map[string]any{}
	for _, k := range slices.Sorted(maps.Keys(in)) {
		if err := explodeInto(out, k, in[k], k); err != nil {
			return nil, fmt.Errorf("explodeMap: %w", err)
		}
	}
	return out, nil
}

// mergeMap merges src into dst (the argument, then the piped map) without
// overriding what dst holds; deep, as dario.cat/mergo's Map.
func mergeMap(dst, src map[string]any) (map[string]any, error) {
	if err := mergo.Map(&dst, src); err != nil {
		return nil, err
	}
	return dst, nil
}

// mergeMapWithOverride is mergeMap with src's values overriding dst's.
func mergeMapWithOverride(dst, src map[string]any) (map[string]any, error) {
	if err := mergo.Map(&dst, src, mergo.WithOverride); err != nil {
		return nil, err
	}
	return dst, nil
}

// indent prefixes every line of s that is not empty with spaces spaces
// (sprig's indent pads after every newline, empty lines included).
func indent(spaces int, s string) (string, error) {
	if spaces < 0 {
		return "", errors.New("indent value must be a positive integer")
	}
	var b strings.Builder
	prefix := strings.Repeat(" ", spaces)
	start := true
	for i := 0; i < len(s); i++ {
		if start && s[i] != '\n' {
			b.WriteString(prefix)
		}
		b.WriteByte(s[i])
		start = s[i] == '\n'
	}
	return b.String(), nil
}

// loop returns the integers from 0 (or the first argument) up to the last
// one, not included. consul-template returns them on a channel; a slice
// ranges the same and is bounded (MaxValue).
func loop(args ...any) ([]int64, error) {
	var from, to any
	switch len(args) {
	case 1:
		from, to = 0, args[0]
	case 2:
		from, to = args[0], args[1]
	default:
		return nil, fmt.Errorf("loop: wrong number of arguments, expected 1 or 2, but got %d", len(args))
	}
	start, err := loopInt(from)
	if err != nil {
		return nil, err
	}
	stop, err := loopInt(to)
	if err != nil {
		return nil, err
	}
	if stop-start > MaxValue {
		return nil, fmt.Errorf("loop: %d to %d is more than %d numbers", start, stop, MaxValue)
	}
	var out []int64
	for i := start; i < stop; i++ {
		out = append(out, i)
	}
	return out, nil
}

func loopInt(v any) (int64, error) {
	rv := reflect.ValueOf(v)
	switch {
	case isInt(rv):
		return rv.Int(), nil
	case isUint(rv):
		return int64(rv.Uint()), nil
	case rv.Kind() == reflect.String:
		return parseInt(rv.String())
	}
	return 0, fmt.Errorf("loop: bad argument type: %T", v)
}

func join(sep string, a []string) string { return strings.Join(a, sep) }

// parseBool, parseFloat, parseInt and parseUint return the zero value for
// "" and an error for what does not parse (sprig's return 0 silently).
func parseBool(s string) (bool, error) {
	if s == "" {
		return false, nil
	}
	v, err := strconv.ParseBool(s)
	if err != nil {
		return false, fmt.Errorf("parseBool: %w", err)
	}
	return v, nil
}

func parseFloat(s string) (float64, error) {
	if s == "" {
		return 0, nil
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, fmt.Errorf("parseFloat: %w", err)
	}
	return v, nil
}

func parseInt(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parseInt: %w", err)
	}
	return v, nil
}

func parseUint(s string) (uint64, error) {
	if s == "" {
		return 0, nil
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parseUint: %w", err)
	}
	return v, nil
}

// parseJSON parses s as JSON; "" is an empty object.
func parseJSON(s string) (any, error) {
	if s == "" {
		return map[string]any{}, nil
	}
	var v any
	if err := json.Unmarshal([]byte(s), &v); err != nil {
		return nil, err
	}
	return v, nil
}

// parseYAML parses s as YAML (yaml.v2, as consul-template); "" is an
// empty map.
func parseYAML(s string) (any, error) {
	if s == "" {
		return map[string]any{}, nil
	}
	var v any
	if err := yaml.Unmarshal([]byte(s), &v); err != nil {
		return nil, err
	}
	return v, nil
}

// regexReplaceAll replaces every match of re in s with repl ($1 for a
// group): regex, replacement, then the string (sprig's order differs).
func regexReplaceAll(re, repl, s string) (string, error) {
	c, err := regexp.Compile(re)
	if err != nil {
		return "", err
	}
	return c.ReplaceAllString(s, repl), nil
}

func regexMatch(re, s string) (bool, error) {
	c, err := regexp.Compile(re)
	if err != nil {
		return false, err
	}
	return c.MatchString(s), nil
}

// hmacSHA256Hex returns the hex HMAC-SHA256 of message with key.
func hmacSHA256Hex(message, key string) string {
	mac := hmac.New(sha256.New, []byte(key))
	mac.Write([]byte(message))
	return hex.EncodeToString(mac.Sum(nil))
}

func toJSON(v any) (string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("toJSON: %w", err)
	}
	return string(bytes.TrimSpace(b)), nil
}

func toJSONPretty(v any) (string, error) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return "", fmt.Errorf("toJSONPretty: %w", err)
	}
	return string(bytes.TrimSpace(b)), nil
}

// unescapedJSON is toJSON without HTML escaping (&, <, > stay).
func unescapedJSON(v any, indent string) (string, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if indent != "" {
		enc.SetIndent("", indent)
	}
	if err := enc.Encode(v); err != nil {
		return "", fmt.Errorf("toUnescapedJSON: %w", err)
	}
	return strings.TrimRight(b.String(), "\r\n"), nil
}

func toYAML(v any) (string, error) {
	b, err := yaml.Marshal(v)
	if err != nil {
		return "", fmt.Errorf("toYAML: %w", err)
	}
	return string(bytes.TrimSpace(b)), nil
}

func toTOML(v any) (string, error) {
	var b bytes.Buffer
	if err := toml.NewEncoder(&b).Encode(v); err != nil {
		return "", fmt.Errorf("toTOML: %w", err)
	}
	return string(bytes.TrimSpace(b.Bytes())), nil
}

// split splits s, trimmed of surrounding space, at sep, in order; "" is
// an empty list (sprig's split returns a map, which range visits _10
// before _2).
func split(sep, s string) []string {
	s = strings.TrimSpace(s)
	if s == "" {
		return []string{}
	}
	return strings.Split(s, sep)
}

// splitToMap splits s at sep1 and each part at sep2 into a key and value;
// a part without sep2 is left out.
func splitToMap(sep1, sep2, s string) map[string]string {
	s = strings.TrimSpace(s)
	m := map[string]string{}
	if s == "" {
		return m
	}
	for part := range strings.SplitSeq(s, sep1) {
		if k, v, ok := strings.Cut(part, sep2); ok {
			m[k] = v
		}
	}
	return m
}

// arith returns an arithmetic function of consul-template's: f(b, a) is
// a OP b — the piped value a comes last, so `5 | subtract 2` is 3. Two
// signed integers, or a signed and an unsigned one, give an int64; two
// unsigned ones a uint64; a float on either side a float64.
func arith(name string, i func(a, b int64) int64, u func(a, b uint64) uint64, f func(a, b float64) float64) func(b, a any) (any, error) {
	return func(b, a any) (any, error) {
		av, bv := reflect.ValueOf(a), reflect.ValueOf(b)
		switch {
		case !isInt(av) && !isUint(av) && !isFloat(av):
			return nil, fmt.Errorf("%s: unknown type for %v (%T)", name, a, a)
		case !isInt(bv) && !isUint(bv) && !isFloat(bv):
			return nil, fmt.Errorf("%s: unknown type for %v (%T)", name, b, b)
		case isFloat(av) || isFloat(bv):
			return f(asFloat(av), asFloat(bv)), nil
		case isUint(av) && isUint(bv):
			return u(av.Uint(), bv.Uint()), nil
		}
		return i(asInt(av), asInt(bv)), nil
	}
}

func asFloat(v reflect.Value) float64 {
	switch {
	case isInt(v):
		return float64(v.Int())
	case isUint(v):
		return float64(v.Uint())
	}
	return v.Float()
}

func asInt(v reflect.Value) int64 {
	if isUint(v) {
		return int64(v.Uint())
	}
	return v.Int()
}

// divide is a / b (`10 | divide 2` is 5); dividing integers by zero is an
// error.
func divide(b, a any) (any, error) {
	bv := reflect.ValueOf(b)
	if (isInt(bv) && bv.Int() == 0 || isUint(bv) && bv.Uint() == 0) && !isFloat(reflect.ValueOf(a)) {
		return nil, errors.New("divide: division by zero")
	}
	return arith("divide", func(a, b int64) int64 { return a / b }, func(a, b uint64) uint64 { return a / b }, func(a, b float64) float64 { return a / b })(b, a)
}

// modulo is a % b for integers (`5 | modulo 2` is 1).
func modulo(b, a any) (any, error) {
	av, bv := reflect.ValueOf(a), reflect.ValueOf(b)
	switch {
	case !isInt(av) && !isUint(av):
		return nil, fmt.Errorf("modulo: unknown type for %v (%T)", a, a)
	case !isInt(bv) && !isUint(bv):
		return nil, fmt.Errorf("modulo: unknown type for %v (%T)", b, b)
	case isUint(bv) && bv.Uint() == 0 || isInt(bv) && bv.Int() == 0:
		return nil, errors.New("modulo: division by zero")
	case isUint(av) && isUint(bv):
		return av.Uint() % bv.Uint(), nil
	}
	return asInt(av) % asInt(bv), nil
}

// extreme returns minimum (sign -1) or maximum (1): the value a or b that
// is smaller or larger, compared in a's kind, returned in its own kind.
func extreme(name string, sign int) func(b, a any) (any, error) {
	return func(b, a any) (any, error) {
		av, bv := reflect.ValueOf(a), reflect.ValueOf(b)
		if !isInt(av) && !isUint(av) && !isFloat(av) {
			return nil, fmt.Errorf("%s: unknown type for %v (%T)", name, a, a)
		}
		if !isInt(bv) && !isUint(bv) && !isFloat(bv) {
			return nil, fmt.Errorf("%s: unknown type for %v (%T)", name, b, b)
		}
		var aFirst bool // a < b (minimum) or a > b (maximum), in a's kind
		switch {
		case isFloat(av) || isFloat(bv):
			x, y := asFloat(av), asFloat(bv)
			aFirst = sign < 0 && x < y || sign > 0 && x > y
		case isUint(av) && isUint(bv):
			x, y := av.Uint(), bv.Uint()
			aFirst = sign < 0 && x < y || sign > 0 && x > y
		default:
			x, y := asInt(av), asInt(bv)
			aFirst = sign < 0 && x < y || sign > 0 && x > y
		}
		if aFirst {
			return own(av), nil
		}
		return own(bv), nil
	}
}

// own returns v as int64, uint64 or float64, by its kind.
func own(v reflect.Value) any {
	switch {
	case isInt(v):
		return v.Int()
	case isUint(v):
		return v.Uint()
	}
	return v.Float()
}
