package config

import (
	"strconv"
	"strings"
)

// keyLines maps a key path (see pathKey) to the 1-based line on which the
// key, table header or array-of-tables header appears. BurntSushi/toml keeps
// positions only per dotted name, so every [[mount]] shares one; this index
// tells them apart by their element number, as the decoded map does.
type keyLines map[string]int

// pathKey joins a key path into a map key. Elements of arrays of tables are
// numbered from 0: mount.1.items.0.key.
func pathKey(path []string) string { return strings.Join(path, "\x00") }

// locateKeys scans a TOML document that has already parsed and records the
// line of every key. It understands comments, all four string forms, arrays,
// inline tables (on one line or several), table headers and arrays of
// tables. Should it meet anything it does not expect, it stops and reports
// complete = false; the keys found so far keep their lines, and lineOf finds
// the others by a plain text search.
func locateKeys(src string) (lines keyLines, complete bool) {
	l := &locator{src: src, line: 1, lines: keyLines{}, arrays: map[string]int{}}
	lines = l.lines
	defer func() {
		// A scanner bug must never break config loading: the parse
		// already succeeded. complete stays false.
		_ = recover()
	}()
	l.document()
	return lines, true
}

// searchLine returns the first line at or after line from (1-based) whose
// text starts with key followed by "=" or ".", as a key definition does; 0
// when there is none. It is the fallback for keys the locator did not reach.
func searchLine(src string, from int, key string) int {
	for i, text := range strings.Split(src, "\n") {
		if i+1 < from {
			continue
		}
		text = strings.TrimSpace(text)
		text = strings.TrimPrefix(strings.TrimPrefix(text, "{"), ",")
		for _, k := range []string{key, strconv.Quote(key), "'" + key + "'"} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(text), k); ok {
				if rest = strings.TrimSpace(rest); strings.HasPrefix(rest, "=") || strings.HasPrefix(rest, ".") {
					return i + 1
				}
			}
		}
	}
	return 0
}

type locator struct {
	src    string
	pos    int
	line   int
	lines  keyLines
	arrays map[string]int // array of tables → elements seen
	table  []string       // path of the current table
}

func (l *locator) document() {
	for {
		l.skipBlank(true)
		if l.pos >= len(l.src) {
			return
		}
		switch {
		case strings.HasPrefix(l.src[l.pos:], "[["):
			l.pos += 2
			l.arrayHeader(l.key())
			l.expect("]]")
		case l.src[l.pos] == '[':
			l.pos++
			l.tableHeader(l.key())
			l.expect("]")
		default:
			line := l.line
			key := l.key()
			path := l.join(l.table, key)
			// A dotted key also defines its parent tables.
			for i := len(l.table) + 1; i <= len(path); i++ {
				l.record(path[:i], line)
			}
			l.skipBlank(false)
			l.expect("=")
			l.value(path)
		}
	}
}

// arrayHeader opens a new element of the array of tables named key.
func (l *locator) arrayHeader(key []string) {
	parent := l.resolve(key[:len(key)-1])
	for i := 1; i <= len(parent); i++ {
		l.record(parent[:i], l.line)
	}
	name := l.join(parent, key[len(key)-1:])
	l.record(name, l.line)
	n := l.arrays[pathKey(name)]
	l.arrays[pathKey(name)] = n + 1
	l.table = l.join(name, []string{strconv.Itoa(n)})
	l.record(l.table, l.line)
}

func (l *locator) tableHeader(key []string) {
	l.table = l.resolve(key)
	// [a.b] also defines a, implicitly, at this line if nowhere before.
	for i := 1; i <= len(l.table); i++ {
		l.record(l.table[:i], l.line)
	}
}

// resolve turns a dotted name into a path, numbering each array of tables it
// passes through with its latest element.
func (l *locator) resolve(key []string) []string {
	var path []string
	for _, k := range key {
		path = append(path, k)
		if n, ok := l.arrays[pathKey(path)]; ok {
			path = append(path, strconv.Itoa(n-1))
		}
	}
	return path
}

func (l *locator) join(a, b []string) []string {
	return append(append(make([]string, 0, len(a)+len(b)), a...), b...)
}

func (l *locator) record(path []string, line int) {
	if _, ok := l.lines[pathKey(path)]; !ok {
		l.lines[pathKey(path)] = line
	}
}

// value skips one value, recording the keys of inline tables and the
// elements of arrays under path.
func (l *locator) value(path []string) {
	l.skipBlank(false)
	rest := l.src[l.pos:]
	switch {
	case strings.HasPrefix(rest, `"""`):
		l.pos += 3
		l.until(`"""`, true)
		l.extraQuotes('"')
	case strings.HasPrefix(rest, "'''"):
		l.pos += 3
		l.until("'''", false)
		l.extraQuotes('\'')
	case rest[0] == '"':
		l.pos++
		l.until(`"`, true)
	case rest[0] == '\'':
		l.pos++
		l.until("'", false)
	case rest[0] == '[':
		l.pos++
		for i := 0; ; i++ {
			l.skipBlank(true)
			if l.peek(']') {
				l.pos++
				return
			}
			elem := l.join(path, []string{strconv.Itoa(i)})
			l.record(elem, l.line)
			l.value(elem)
			l.skipBlank(true)
			if l.peek(',') {
				l.pos++
			}
		}
	case rest[0] == '{':
		// TOML 1.1 (which BurntSushi/toml reads) lets an inline table
		// span lines, with comments and a trailing comma.
		l.pos++
		for {
			l.skipBlank(true)
			if l.peek('}') {
				l.pos++
				return
			}
			line := l.line
			key := l.join(path, l.key())
			l.record(key, line)
			l.skipBlank(true)
			l.expect("=")
			l.value(key)
			l.skipBlank(true)
			if l.peek(',') {
				l.pos++
			}
		}
	default:
		// A number, boolean or date: up to a delimiter.
		for l.pos < len(l.src) && !strings.ContainsRune(",]}#\n", rune(l.src[l.pos])) {
			l.pos++
		}
	}
}

// key reads a dotted key of bare and quoted parts.
func (l *locator) key() []string {
	var parts []string
	for {
		l.skipBlank(false)
		switch {
		case l.peek('"'):
			start := l.pos
			l.pos++
			l.until(`"`, true)
			raw := l.src[start:l.pos]
			if s, err := strconv.Unquote(raw); err == nil {
				parts = append(parts, s)
			} else {
				parts = append(parts, raw[1:len(raw)-1])
			}
		case l.peek('\''):
			l.pos++
			start := l.pos
			l.until("'", false)
			parts = append(parts, l.src[start:l.pos-1])
		default:
			start := l.pos
			for l.pos < len(l.src) && isBare(l.src[l.pos]) {
				l.pos++
			}
			if l.pos == start {
				panic("locator: no key")
			}
			parts = append(parts, l.src[start:l.pos])
		}
		l.skipBlank(false)
		if !l.peek('.') {
			return parts
		}
		l.pos++
	}
}

func isBare(c byte) bool {
	return c == '_' || c == '-' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// until advances past the next end, honouring backslash escapes when
// escapes is set, and counts lines on the way.
func (l *locator) until(end string, escapes bool) {
	for l.pos < len(l.src) {
		if escapes && l.src[l.pos] == '\\' {
			l.advance()
			l.advance()
			continue
		}
		if strings.HasPrefix(l.src[l.pos:], end) {
			l.pos += len(end)
			return
		}
		l.advance()
	}
}

// extraQuotes consumes the up to two quotes that may close a multi-line
// string right before its delimiter ("""a"""" ends in a quote).
func (l *locator) extraQuotes(q byte) {
	for range 2 {
		if l.peek(q) {
			l.pos++
		}
	}
}

func (l *locator) advance() {
	if l.pos < len(l.src) {
		if l.src[l.pos] == '\n' {
			l.line++
		}
		l.pos++
	}
}

// skipBlank skips spaces, tabs and comments, and newlines too when lines is
// set.
func (l *locator) skipBlank(lines bool) {
	for l.pos < len(l.src) {
		switch c := l.src[l.pos]; {
		case c == ' ' || c == '\t' || c == '\r':
			l.pos++
		case c == '\n' && lines:
			l.advance()
		case c == '#':
			for l.pos < len(l.src) && l.src[l.pos] != '\n' {
				l.pos++
			}
		default:
			return
		}
	}
}

func (l *locator) peek(c byte) bool { return l.pos < len(l.src) && l.src[l.pos] == c }

func (l *locator) expect(s string) {
	if !strings.HasPrefix(l.src[l.pos:], s) {
		panic("locator: want " + s)
	}
	l.pos += len(s)
}
