package origin

import (
	"net/url"
	"strings"
	"testing"
)

// TestRedact: user information, query values and fragments never survive;
// what identifies the URL does.
func TestRedact(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"https://config.example.com/app.json", "https://config.example.com/app.json"},
		{"https://TOKEN@config.example.com/app.json", "https://redacted@config.example.com/app.json"},
		{"https://user:pass@h:8443/a", "https://redacted@h:8443/a"},
		{"https://h/a?token=abc&v=1", "https://h/a?token=redacted&v=redacted"},
		{"https://h/a#access_token=abc", "https://h/a#redacted"},
		{"://bad", "(unparsable URL)"},
	} {
		got := Redact(tt.in)
		if got != tt.want {
			t.Errorf("Redact(%q) = %q; want %q", tt.in, got, tt.want)
		}
		for _, secret := range []string{"TOKEN", "pass", "abc"} {
			if strings.Contains(got, secret) {
				t.Errorf("Redact(%q) = %q keeps %q", tt.in, got, secret)
			}
		}
	}
}

func TestOf(t *testing.T) {
	for _, tt := range []struct{ a, b string }{
		{"https://h/x", "https://H:443/y"},
		{"http://h", "http://h:80/"},
	} {
		ua, _ := url.Parse(tt.a)
		ub, _ := url.Parse(tt.b)
		if Of(ua) != Of(ub) {
			t.Errorf("Of(%s) = %s, Of(%s) = %s; want one origin", tt.a, Of(ua), tt.b, Of(ub))
		}
	}
	ua, _ := url.Parse("https://h")
	ub, _ := url.Parse("http://h:443")
	if Of(ua) == Of(ub) {
		t.Error("https://h and http://h:443 are one origin")
	}
}
