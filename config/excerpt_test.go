package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestExcerpt: an excerpt holds the named sources and mounts, and parses
// to the same settings as the whole file — whatever form a table took
// (inline, array of tables, dotted keys) — and nothing of the others.
func TestExcerpt(t *testing.T) {
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("s3cr3t\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	text := `# a comment
state_dir = "/var/lib/kvmount-excerpt"
log_level = "debug"
max_total_size = "64MiB"
admin.address = "127.0.0.1:9101"

[sources.a]
type = "fake"
endpoint = "https://a.example:2379"

[sources.b]
type = "fake"
endpoint = "https://b.example:8500/?token=elsewhere"

[[mount]]
name = "one"
dir = "/srv/one"
source = "a"
prefix = "one/"
default_mode = "0640"
items = [{ key = "x", path = "x.conf", mode = "0400" }, { key = "y", path = "y" }]
wait = { min = "1s", max = "4s" }
  [[mount.notify]]
  webhook = "https://127.0.0.1:8443/hook"
  header_files = { Authorization = "` + token + `" }
  [[mount.templates]]
  path = "t.conf"
  text = '''
{{ key "x" }} """ ' [sources.b]
'''

[[mount]]
name = "two"
dir = "/srv/two"
medium = "tmpfs"
size_limit = "1MiB"
  [[mount.projections]]
  source = "b"
  prefix = "two/"
  [[mount.notify]]
  webhook = "https://127.0.0.1:9443/other"
`
	whole, err := Parse("k.toml", []byte(text), testKinds)
	if err != nil {
		t.Fatal(err)
	}
	part, err := Excerpt([]byte(text), []string{"a"}, []string{"one"})
	if err != nil {
		t.Fatal(err)
	}
	for _, other := range []string{"b.example", "elsewhere", "/srv/two", "9443"} {
		if strings.Contains(string(part), other) {
			t.Errorf("the excerpt holds %q of the other domain:\n%s", other, part)
		}
	}
	cfg, err := Parse("k.toml", part, testKinds)
	if err != nil {
		t.Fatalf("the excerpt does not parse: %v\n%s", err, part)
	}
	if len(cfg.Sources) != 1 || len(cfg.Mounts) != 1 {
		t.Fatalf("sources %v, mounts %d", cfg.Sources, len(cfg.Mounts))
	}
	if !reflect.DeepEqual(cfg.Sources["a"], whole.Sources["a"]) {
		t.Errorf("source a: %+v, want %+v", cfg.Sources["a"], whole.Sources["a"])
	}
	got, want := *cfg.Mounts[0], *whole.Mounts[0]
	if len(got.Templates) != 1 || got.Templates[0].Path != want.Templates[0].Path {
		t.Errorf("templates %+v, want %+v", got.Templates, want.Templates)
	}
	got.Templates, want.Templates = nil, nil
	if !reflect.DeepEqual(got, want) {
		t.Errorf("mount one:\n%+v\nwant\n%+v", got, want)
	}
	if cfg.StateDir != whole.StateDir || cfg.LogLevel != whole.LogLevel || cfg.MaxTotalSize != whole.MaxTotalSize || cfg.Admin != whole.Admin {
		t.Errorf("top-level settings differ: %+v", cfg)
	}
	none, err := Excerpt([]byte(text), []string{"b"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg, err := Parse("k.toml", none, testKinds); err != nil || len(cfg.Mounts) != 0 || cfg.Sources["b"] == nil {
		t.Errorf("a source no mount uses: %v %+v\n%s", err, cfg, none)
	}
	if _, err := Excerpt([]byte("x = "), nil, nil); err == nil {
		t.Error("no error for a text that is not TOML")
	}
}
