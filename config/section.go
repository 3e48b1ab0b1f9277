package config

import (
	"fmt"
	"io/fs"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// document is one configuration file being decoded: its key lines and the
// problems found so far.
type document struct {
	file     string
	src      string
	lines    keyLines
	complete bool // the locator read the whole file
	files    Files
	errs     ErrorList
	warnings ErrorList
}

func (d *document) add(line int, key, format string, args ...any) {
	d.errs = append(d.errs, &Error{File: d.file, Line: line, Key: key, Msg: fmt.Sprintf(format, args...)})
}

// Section is one table of the configuration file being decoded. Its getters
// read a key, convert it and record every problem, with file and line, in
// the file's error list, so that all problems are reported at once; on a
// problem they return the default. Done reports the keys nobody asked for.
// Source kinds decode their [sources.NAME] table through a Section.
type Section struct {
	doc     *document
	path    []string // key path for line lookups, arrays numbered
	display string   // the path as shown to people: mount[1].items[0]
	table   map[string]any
	// used holds the keys of table a getter asked for; asked, every key
	// a getter asked for, set or not (with repeats), which Done suggests
	// from.
	used  map[string]bool
	asked []string
}

func newSection(doc *document, path []string, display string, table map[string]any) *Section {
	return &Section{doc: doc, path: path, display: display, table: table, used: make(map[string]bool, len(table))}
}

// use marks key as known.
func (s *Section) use(key string) {
	s.asked = append(s.asked, key)
	if _, set := s.table[key]; set {
		s.used[key] = true
	}
}

// Name returns the section's dotted name, such as "sources.main".
func (s *Section) Name() string { return s.display }

// Has reports whether key is set.
func (s *Section) Has(key string) bool {
	s.use(key)
	_, ok := s.table[key]
	return ok
}

// Line returns the line of key, or of the section when key is "" or has no
// known line.
func (s *Section) Line(key string) int {
	section := s.doc.lines[pathKey(s.path)]
	if key != "" {
		if line, ok := s.doc.lines[pathKey(append(slices.Clone(s.path), key))]; ok {
			return line
		}
		if _, present := s.table[key]; present && !s.doc.complete {
			// The locator stopped early: find the key by its text.
			if line := searchLine(s.doc.src, max(section, 1), key); line > 0 {
				return line
			}
		}
	}
	return section
}

// Errorf records a problem with key ("" for the section itself) at its line.
func (s *Section) Errorf(key, format string, args ...any) {
	s.doc.add(s.Line(key), s.keyName(key), format, args...)
}

// Warnf records something valid but probably unintended about key, such as
// a prefix without a trailing "/"; it does not fail the file.
func (s *Section) Warnf(key, format string, args ...any) {
	s.doc.warnings = append(s.doc.warnings, &Error{File: s.doc.file, Line: s.Line(key), Key: s.keyName(key), Msg: fmt.Sprintf(format, args...)})
}

// DurationAtLeast is Duration with a lower bound: a shorter duration is an
// error naming the bound.
func (s *Section) DurationAtLeast(key string, def, least time.Duration) time.Duration {
	d := s.Duration(key, def)
	if d < least {
		s.Errorf(key, "%v is shorter than the minimum of %v", d, least)
		return def
	}
	return d
}

func (s *Section) keyName(key string) string {
	switch {
	case key == "":
		return s.display
	case s.display == "":
		return key
	}
	return s.display + "." + key
}

// get marks key as known and returns its raw value.
func (s *Section) get(key string) (any, bool) {
	s.use(key)
	v, ok := s.table[key]
	return v, ok
}

// String returns the string at key, or def when it is not set.
func (s *Section) String(key, def string) string {
	v, ok := s.get(key)
	if !ok {
		return def
	}
	str, ok := v.(string)
	if !ok {
		s.Errorf(key, "want a string, got %s", typeName(v))
		return def
	}
	return str
}

// Choice returns the string at key, which must be one of choices; def when
// it is not set.
func (s *Section) Choice(key, def string, choices ...string) string {
	v := s.String(key, def)
	if !slices.Contains(choices, v) {
		s.Errorf(key, "%q is not one of %s", v, strings.Join(choices, ", "))
		return def
	}
	return v
}

// Bool returns the boolean at key, or def when it is not set.
func (s *Section) Bool(key string, def bool) bool {
	v, ok := s.get(key)
	if !ok {
		return def
	}
	b, ok := v.(bool)
	if !ok {
		s.Errorf(key, "want true or false, got %s", typeName(v))
		return def
	}
	return b
}

// Int returns the integer at key, which must lie in [min, max]; def when it
// is not set.
func (s *Section) Int(key string, def, min, max int64) int64 {
	v, ok := s.get(key)
	if !ok {
		return def
	}
	n, ok := v.(int64)
	if !ok {
		s.Errorf(key, "want an integer, got %s", typeName(v))
		return def
	}
	if n < min || n > max {
		s.Errorf(key, "%d is outside %d..%d", n, min, max)
		return def
	}
	return n
}

// Duration returns the Go duration string at key ("30s", "5m"), which must be
// positive; def when it is not set.
func (s *Section) Duration(key string, def time.Duration) time.Duration {
	return s.duration(key, def, false)
}

// DurationOrZero is Duration that also takes "0s" (or "0"): for a setting
// whose zero means "at once" or "none".
func (s *Section) DurationOrZero(key string, def time.Duration) time.Duration {
	return s.duration(key, def, true)
}

// duration returns the duration at key; zero is an error unless zeroOK,
// a negative one always.
func (s *Section) duration(key string, def time.Duration, zeroOK bool) time.Duration {
	v, ok := s.get(key)
	if !ok {
		return def
	}
	str, ok := v.(string)
	if !ok {
		s.Errorf(key, "want a duration string such as \"30s\", got %s", typeName(v))
		return def
	}
	d, err := time.ParseDuration(str)
	if err != nil {
		s.Errorf(key, "bad duration %q: want a Go duration such as \"500ms\", \"30s\" or \"5m\"", str)
		return def
	}
	switch {
	case d < 0 && zeroOK:
		s.Errorf(key, "duration %q must not be negative", str)
		return def
	case d <= 0 && !zeroOK:
		s.Errorf(key, "duration %q must be positive", str)
		return def
	}
	return d
}

// Mode returns the permission bits at key: an octal string ("0644", "644",
// "0o644") or a TOML integer (0o644). Bits beyond 0o777 are an error.
func (s *Section) Mode(key string, def fs.FileMode) fs.FileMode {
	v, ok := s.get(key)
	if !ok {
		return def
	}
	var n uint64
	switch v := v.(type) {
	case string:
		var err error
		n, err = strconv.ParseUint(strings.TrimPrefix(strings.TrimPrefix(v, "0o"), "0O"), 8, 32)
		if err != nil || v == "" {
			s.Errorf(key, "bad mode %q: want an octal string such as \"0644\"", v)
			return def
		}
	case int64:
		if v < 0 {
			s.Errorf(key, "bad mode %d", v)
			return def
		}
		n = uint64(v)
	default:
		s.Errorf(key, "want an octal mode string such as \"0644\", got %s", typeName(v))
		return def
	}
	if n > 0o777 {
		s.Errorf(key, "mode %#o has bits beyond 0777", n)
		return def
	}
	if n == 0 {
		s.Errorf(key, "mode 0 gives nobody access; leave %s out for the default, or set one such as \"0644\"", key)
		return def
	}
	return fs.FileMode(n)
}

// Size returns the byte count at key: an integer, or a string with a unit
// B, KiB, MiB or GiB ("16MiB"). It must be positive.
func (s *Section) Size(key string, def int64) int64 {
	v, ok := s.get(key)
	if !ok {
		return def
	}
	switch v := v.(type) {
	case int64:
		if v <= 0 {
			s.Errorf(key, "size %d must be positive", v)
			return def
		}
		return v
	case string:
		n, err := parseSize(v)
		if err != nil {
			s.Errorf(key, "%v", err)
			return def
		}
		return n
	}
	s.Errorf(key, "want a size such as \"16MiB\", got %s", typeName(v))
	return def
}

func parseSize(v string) (int64, error) {
	units := []struct {
		suffix string
		scale  int64
	}{{"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}, {"", 1}}
	str := strings.TrimSpace(v)
	for _, u := range units {
		if !strings.HasSuffix(str, u.suffix) {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(str, u.suffix)), 10, 64)
		if err != nil || n <= 0 || n > math.MaxInt64/u.scale {
			break
		}
		return n * u.scale, nil
	}
	return 0, fmt.Errorf("bad size %q: want a positive number of bytes with an optional unit KiB, MiB or GiB, such as \"16MiB\"", v)
}

// Strings returns the array of strings at key, or nil when it is not set.
func (s *Section) Strings(key string) []string {
	v, ok := s.get(key)
	if !ok {
		return nil
	}
	list, ok := v.([]any)
	if !ok {
		s.Errorf(key, "want an array of strings, got %s", typeName(v))
		return nil
	}
	out := make([]string, 0, len(list))
	for i, e := range list {
		str, ok := e.(string)
		if !ok {
			s.Errorf(key, "element %d: want a string, got %s", i, typeName(e))
			continue
		}
		out = append(out, str)
	}
	return out
}

// StringMap returns the table of strings at key, or nil when it is not set.
func (s *Section) StringMap(key string) map[string]string {
	v, ok := s.get(key)
	if !ok {
		return nil
	}
	table, ok := v.(map[string]any)
	if !ok {
		s.Errorf(key, "want a table of strings, got %s", typeName(v))
		return nil
	}
	out := make(map[string]string, len(table))
	for k, e := range table {
		str, ok := e.(string)
		if !ok {
			s.Errorf(key, "%s: want a string, got %s", k, typeName(e))
			continue
		}
		out[k] = str
	}
	return out
}

// Table returns the table (inline or not) at key as a Section. When key is
// not set it returns an empty Section, so getters return their defaults.
func (s *Section) Table(key string) *Section {
	path := append(slices.Clone(s.path), key)
	v, ok := s.get(key)
	if !ok {
		return newSection(s.doc, path, s.keyName(key), nil)
	}
	table, ok := v.(map[string]any)
	if !ok {
		s.Errorf(key, "want a table, got %s", typeName(v))
		return newSection(s.doc, path, s.keyName(key), nil)
	}
	return newSection(s.doc, path, s.keyName(key), table)
}

// Tables returns the array of tables at key ([[key]] or an array of inline
// tables), one Section per element, or nil when it is not set.
func (s *Section) Tables(key string) []*Section {
	v, ok := s.get(key)
	if !ok {
		return nil
	}
	var tables []map[string]any
	switch v := v.(type) {
	case []map[string]any:
		tables = v
	case []any:
		for i, e := range v {
			t, ok := e.(map[string]any)
			if !ok {
				s.Errorf(key, "element %d: want a table, got %s", i, typeName(e))
				return nil
			}
			tables = append(tables, t)
		}
	default:
		s.Errorf(key, "want an array of tables ([[%s]]), got %s", key, typeName(v))
		return nil
	}
	out := make([]*Section, len(tables))
	for i, t := range tables {
		path := append(slices.Clone(s.path), key, strconv.Itoa(i))
		out[i] = newSection(s.doc, path, fmt.Sprintf("%s[%d]", s.keyName(key), i), t)
	}
	return out
}

// Keys returns the section's keys, sorted, marking them known.
func (s *Section) Keys() []string {
	keys := make([]string, 0, len(s.table))
	for k := range s.table {
		keys = append(keys, k)
		s.use(k)
	}
	slices.Sort(keys)
	return keys
}

// Done reports every key of the section that no getter asked for as unknown,
// suggesting the closest known key for a typo.
func (s *Section) Done() {
	var unknown []string
	for k := range s.table {
		if !s.used[k] {
			unknown = append(unknown, k)
		}
	}
	slices.SortFunc(unknown, func(a, b string) int { return s.Line(a) - s.Line(b) })
	for _, k := range unknown {
		if near := s.closest(k); near != "" {
			s.Errorf(k, "unknown key (did you mean %q?)", near)
		} else {
			s.Errorf(k, "unknown key")
		}
	}
}

// closest returns the known key nearest to k by edit distance, if it is
// within two edits.
func (s *Section) closest(k string) string {
	best, bestDist := "", 3
	for _, known := range s.asked {
		if _, set := s.table[known]; set {
			continue
		}
		if d := editDistance(k, known); d < bestDist {
			best, bestDist = known, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b, in bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func typeName(v any) string {
	switch v.(type) {
	case string:
		return "a string"
	case int64:
		return "an integer"
	case float64:
		return "a float"
	case bool:
		return "a boolean"
	case []any, []map[string]any:
		return "an array"
	case map[string]any:
		return "a table"
	case time.Time:
		return "a date-time"
	}
	return fmt.Sprintf("%T", v)
}
