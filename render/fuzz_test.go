package render

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// FuzzHelpers renders consul-template's string and structure helpers over
// a fuzzed value: no panic escapes, every render ends within its limits,
// and the same value renders the same bytes twice.
func FuzzHelpers(f *testing.F) {
	for _, seed := range []string{"a,b", "", "{\"a\":1}", "x: [1, 2]", "foo:bar\nbaz:bat", "  spaced  ", "ü\x00\xff", strings.Repeat("a/", 50)} {
		f.Add(seed, "/", 2)
	}
	text := `{{ $v := key "v" }}{{ $s := key "s" }}` +
		`{{ split $s $v | join "|" }}{{ splitToMap "\n" ":" $v }}{{ indent (key "n" | sprig_atoi) $v }}` +
		`{{ trim $s $v }}{{ replaceAll $s "-" $v }}{{ toUpper $v }}{{ toTitle $v }}{{ base64Encode $v | base64Decode }}` +
		`{{ with parseJSON $v }}{{ toJSON . }}{{ end }}{{ with parseYAML $v }}{{ . }}{{ end }}{{ $v | sha256Hex }}{{ in $v $s }}` +
		`{{ range tree "" | explode }}{{ . }}{{ end }}`
	tmpl, err := Parse("fuzz", text)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, v, sep string, n int) {
		keys := keyView("v", v, "s", sep, "n", strconv.Itoa(max(n, -n)%200), "t/"+strings.ReplaceAll(v, "\x00", ""), v)
		start := time.Now()
		first, _, err1 := tmpl.Execute(keys, Limits{MaxOutput: 1 << 20, Timeout: time.Second})
		second, _, err2 := tmpl.Execute(keys, Limits{MaxOutput: 1 << 20, Timeout: time.Second})
		if time.Since(start) > 5*time.Second {
			t.Fatalf("two renders took %v", time.Since(start))
		}
		if (err1 == nil) != (err2 == nil) || string(first) != string(second) {
			t.Fatalf("%q rendered %q (%v), then %q (%v)", v, first, err1, second, err2)
		}
	})
}
