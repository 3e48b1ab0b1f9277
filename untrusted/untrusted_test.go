package untrusted

import (
	"testing"
	"unicode"
	"unicode/utf8"
)

func TestEscape(t *testing.T) {
	tests := []struct{ in, want string }{
		{"app.conf", "app.conf"},
		{"straße/größe", "straße/größe"},
		{"", ""},
		{"a\nb", `a\nb`},
		{"..2026_11_22_01_02_03.1\x1b]0;pwned\a\r\nother current", `..2026_11_22_01_02_03.1\x1b]0;pwned\a\r\nother current`},
		{"csi\u009b2J", `csi\u009b2J`},
		{"evil\u202egnp.exe", `evil\u202egnp.exe`},
		{"iso\u2066late\u2069", `iso\u2066late\u2069`},
		{"zero\u200bwidth\ufeff", `zero\u200bwidth\ufeff`},
		{"line\u2028sep", `line\u2028sep`},
		{"del\x7f", `del\x7f`},
		{"bad\xffutf8\xc3", `bad\xffutf8\xc3`},
		{`back\slash`, `back\\slash`},
		{`\x1b`, `\\x1b`},
	}
	for _, tt := range tests {
		if got := Escape(tt.in); got != tt.want {
			t.Errorf("Escape(%q) = %q; want %q", tt.in, got, tt.want)
		}
	}
}

// TestEscapeLeavesNothingRaw: over every code point, what Escape returns
// holds no control or format character and is valid UTF-8.
func TestEscapeLeavesNothingRaw(t *testing.T) {
	for r := rune(0); r <= unicode.MaxRune; r++ {
		if r >= 0xd800 && r <= 0xdfff {
			continue
		}
		out := Escape("x" + string(r) + "y")
		if !utf8.ValidString(out) {
			t.Fatalf("Escape(%U) = %q: invalid UTF-8", r, out)
		}
		for _, c := range out {
			if unicode.Is(unicode.Cc, c) || unicode.Is(unicode.Cf, c) || c == '\u2028' || c == '\u2029' {
				t.Fatalf("Escape(%U) = %q keeps %U", r, out, c)
			}
		}
	}
}

func FuzzEscape(f *testing.F) {
	f.Add("a\x1b[2J\u202e\xff")
	f.Fuzz(func(t *testing.T, s string) {
		out := Escape(s)
		if !utf8.ValidString(out) {
			t.Fatalf("Escape(%q) = %q: invalid UTF-8", s, out)
		}
		for _, c := range out {
			if unicode.Is(unicode.Cc, c) || unicode.Is(unicode.Cf, c) {
				t.Fatalf("Escape(%q) = %q keeps %U", s, out, c)
			}
		}
	})
}
