package render

import (
	"encoding/json"
	"strings"
	"testing"
)

// secretView returns keys whose projections read a KV v2 secret (by both
// of its paths), a KV v1 secret and a PKI issue.
func secretView() *Keys {
	kv2 := NewSecret("", 0, false, map[string]any{
		"data":     map[string]any{"user": "ada", "password": "s3cret", "port": json.Number("5432")},
		"metadata": map[string]any{"version": json.Number("3")},
	}, nil)
	k := NewKeys()
	k.AddSecrets(Secrets{
		"secret/data/app/db": kv2,
		"secret/app/db":      kv2,
		"kv/app":             NewSecret("", 2764800, false, map[string]any{"token": "t0"}, nil),
		"pki/issue/web": NewSecret("pki/issue/web/abc", 3600, false, map[string]any{"certificate": "CERT", "private_key": "KEY"},
			map[string]string{"common_name": "web.example.com", "ttl": "24h"}),
	})
	return k
}

// TestSecret renders consul-template's secret as its users write it, and
// refuses what no projection of the mount holds.
func TestSecret(t *testing.T) {
	keys := secretView()
	for _, tc := range []struct{ text, want, err string }{
		{`{{ with secret "secret/data/app/db" }}{{ .Data.data.user }}:{{ .Data.data.password }}@{{ .Data.data.port }} v{{ .Data.metadata.version }}{{ end }}`, "ada:s3cret@5432 v3", ""},
		{`{{ with secret "secret/app/db" }}{{ .Data.data.user }}{{ end }}`, "ada", ""},
		{`{{ (secret "/kv/app/").Data.token }} {{ (secret "kv/app").LeaseDuration }}`, "t0 2764800", ""},
		{`{{ with secret "pki/issue/web" "common_name=web.example.com" }}{{ .Data.certificate }} {{ .LeaseID }}{{ end }}`, "CERT pki/issue/web/abc", ""},
		{`{{ with secret "pki/issue/web" "common_name=web.example.com" "ttl=24h" }}{{ .Data.private_key }}{{ end }}`, "KEY", ""},
		{`{{ with secret "pki/issue/web" "common_name=other.example.com" }}{{ end }}`, "", `parameter common_name="other.example.com" differs from the mount's projection, which issues with common_name="web.example.com" ttl="24h"`},
		{`{{ with secret "pki/issue/web" "ttl" }}{{ end }}`, "", `parameter "ttl" is not KEY=VALUE`},
		{`{{ with secret "kv/app" "a=b" }}{{ end }}`, "", "parameters (a=b) are for a write"},
		{`{{ with secret "secret/data/other" }}{{ end }}`, "", `secret "secret/data/other": no Vault projection of the mount holds it`},
		{`{{ with secret "secret/data/app/db" }}{{ .Data.data.nope }}{{ end }}`, "", `map has no entry for key "nope"`}, // missingkey=error, as for every map
	} {
		got, err := run(t, tc.text, keys)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s: %q, %v; want an error with %q", tc.text, got, err, tc.err)
		case tc.err == "" && (err != nil || got != tc.want):
			t.Errorf("%s: %q, %v; want %q", tc.text, got, err, tc.want)
		}
	}
}

// TestSecretCalls: the calls of secret with their literal paths and lines,
// for kvmount check; a path that is not a literal is reported as "".
func TestSecretCalls(t *testing.T) {
	tmpl, err := Parse("t", "a\n{{ with secret \"secret/data/app/db\" }}{{ end }}\n{{ secret (printf \"kv/%s\" \"x\") }}\n{{ with secret \"pki/issue/web\" \"common_name=a\" }}{{ end }}")
	if err != nil {
		t.Fatal(err)
	}
	got := tmpl.SecretCalls()
	want := []SecretCall{{Path: "secret/data/app/db", Line: 2}, {Path: "", Line: 3}, {Path: "pki/issue/web", Params: []string{"common_name=a"}, Line: 4}}
	if len(got) != len(want) {
		t.Fatalf("calls %+v; want %+v", got, want)
	}
	for i := range want {
		if got[i].Path != want[i].Path || got[i].Line != want[i].Line || strings.Join(got[i].Params, ",") != strings.Join(want[i].Params, ",") {
			t.Errorf("call %d: %+v; want %+v", i, got[i], want[i])
		}
	}
}

// TestCacheSecret: a template that read a secret renders again when the
// secret changes, and not when another one does.
func TestCacheSecret(t *testing.T) {
	tmpl, err := Parse("t", `{{ with secret "kv/a" }}{{ .Data.v }}{{ end }}`)
	if err != nil {
		t.Fatal(err)
	}
	view := func(a, b string) *Keys {
		k := NewKeys()
		k.AddSecrets(Secrets{"kv/a": NewSecret("", 0, false, map[string]any{"v": a}, nil), "kv/b": NewSecret("", 0, false, map[string]any{"v": b}, nil)})
		return k
	}
	var cache Cache
	for i, s := range []struct {
		keys    *Keys
		want    string
		renders int64
	}{
		{view("1", "x"), "1", 1},
		{view("1", "y"), "1", 0},
		{view("2", "y"), "2", 1},
	} {
		before := executions.Load()
		out, err := cache.Render(tmpl, s.keys, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		if got, n := string(out), executions.Load()-before; got != s.want || n != s.renders {
			t.Errorf("step %d: %q after %d renders; want %q after %d", i, got, n, s.want, s.renders)
		}
	}
}
