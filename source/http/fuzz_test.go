package http

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// FuzzFlatten feeds untrusted response bodies to Flatten: it never panics;
// when it succeeds, every value is one of the body's JSON strings at the
// path of its nested keys, and nothing else is produced.
func FuzzFlatten(f *testing.F) {
	for _, seed := range []string{
		`{"a": "1", "b": {"c": "2"}}`, `{"a/b": "1", "a": {"b": "2"}}`, `{"": "x"}`, `{"a": {"": "y"}}`,
		`{"a": true}`, `[]`, `"s"`, `{} {}`, `{"a": "\u0000"}`, `{"a":{"b":{"c":{"d":"deep"}}}}`, ``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		got, err := Flatten(body)
		if err != nil {
			return
		}
		var doc any
		if err := json.Unmarshal(body, &doc); err != nil {
			t.Fatalf("Flatten accepted %q, which is not JSON: %v", body, err)
		}
		n := 0
		var walk func(prefix string, v any)
		walk = func(prefix string, v any) {
			switch v := v.(type) {
			case map[string]any:
				for k, child := range v {
					walk(prefix+k+"/", child)
				}
			case string:
				n++
				key := strings.TrimSuffix(prefix, "/")
				if string(got[key]) != v {
					t.Fatalf("Flatten(%q)[%q] = %q; want %q", body, key, got[key], v)
				}
			default:
				t.Fatalf("Flatten accepted %q holding a %T", body, v)
			}
		}
		walk("", doc)
		if n != len(got) {
			t.Fatalf("Flatten(%q) gave %d keys; the body has %d strings", body, len(got), n)
		}
	})
}

// FuzzRetryAfter feeds untrusted Retry-After values to retryAfter: it
// never panics, and any wait it accepts lies within 1 s and MaxRetryAfter.
func FuzzRetryAfter(f *testing.F) {
	now := time.Date(2026, 11, 22, 1, 0, 0, 0, time.UTC)
	for _, seed := range []string{"120", "0", "-1", "99999999999999999999", now.Format(http.TimeFormat), "Sun, 06 Nov 1994 08:49:37 GMT", "soon", " 5 ", ""} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, value string) {
		d, ok := retryAfter(value, now)
		if !ok {
			if d != 0 {
				t.Fatalf("retryAfter(%q) = %v, false; want 0 when refused", value, d)
			}
			return
		}
		if d < time.Second || d > MaxRetryAfter {
			t.Fatalf("retryAfter(%q) = %v; want within [1s, %v]", value, d, MaxRetryAfter)
		}
	})
}
