// Package untrusted escapes outside text — key names, symlink targets,
// version names found on disk, a server's status line, a command's output —
// before it reaches a terminal, a log line or systemd's STATUS=. It is the
// one place that does: every other package calls Escape, so that no path
// forgets a character class.
//
// A user or a store writer who chooses such text must not be able to forge
// a line (a newline, a carriage return), drive a terminal (ESC and the C1
// control CSI, U+009B, begin escape sequences), reorder what an operator
// reads (bidirectional overrides and isolates, U+202A–U+202E,
// U+2066–U+2069) or hide text (zero-width format characters). Escape
// replaces every such character with a Go-style escape, so that what it
// was stays visible.
package untrusted

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Escape returns s with every character that could forge, hide or reorder
// what a reader sees written as an escape: control characters (Unicode
// category Cc: C0, DEL and the C1 controls U+0080–U+009F) as \n, \r, \t,
// \x1b, \u009b; format characters (Cf: bidirectional overrides and
// isolates, zero-width joiners, U+FEFF, soft hyphen, ...) and the line and
// paragraph separators U+2028 and U+2029 as \u202e and the like; each byte
// of invalid UTF-8 as \xff; and the backslash itself as \\, so that an
// escape in s cannot pass for one Escape wrote. Everything else, non-ASCII
// letters included, is kept. Escape(Escape(s)) differs from Escape(s) only
// in doubled backslashes; a string with nothing to escape is returned as
// it is, without allocating.
func Escape(s string) string {
	i := 0
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		if needsEscape(r, size) {
			break
		}
		i += size
	}
	if i == len(s) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 8)
	b.WriteString(s[:i])
	for i < len(s) {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && size == 1:
			b.WriteString(`\x`)
			b.WriteString(strconv.FormatUint(uint64(s[i])|0x100, 16)[1:])
		case r == '\\':
			b.WriteString(`\\`)
		case needsEscape(r, size):
			q := strconv.QuoteRuneToASCII(r) // 'x' with Go's escape inside
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	return b.String()
}

// needsEscape reports whether the rune r, size bytes long in its string,
// is one Escape writes as an escape.
func needsEscape(r rune, size int) bool {
	switch {
	case r == utf8.RuneError && size == 1, r == '\\':
		return true
	case r < utf8.RuneSelf:
		return r < 0x20 || r == 0x7f
	}
	return unicode.Is(unicode.Cc, r) || unicode.Is(unicode.Cf, r) || r == '\u2028' || r == '\u2029'
}
