package vault

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/internal/vaulttest"
	"github.com/kvmount/kvmount/source"
)

// writeFile writes content to a new file of mode 0600 in dir.
func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// decode parses a configuration of one vault source "v" whose table holds
// table (TOML lines), and returns its settings; problems fail the test.
func decode(t *testing.T, table string) *Config {
	t.Helper()
	cfg, err := config.Parse("test.toml", []byte("[sources.v]\ntype = \"vault\"\n"+table+"\n[[mount]]\nname = \"m\"\ndir = \"/srv/m\"\nmedium = \"tmpfs\"\nsource = \"v\"\nprefix = \"secret/m/\"\n"),
		map[string]config.SourceDecoder{"vault": Decode})
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Sources["v"].Settings.(*Config)
}

// tokenSource returns a source reading srv with the root token from a
// token file, polling every 100 ms, and the buffer its log goes to.
func tokenSource(t *testing.T, srv *vaulttest.Server, extra string) (*Source, *testlog.Buffer) {
	t.Helper()
	tok := writeFile(t, t.TempDir(), "token", vaulttest.RootToken+"\n")
	return openTest(t, fmt.Sprintf("address = %q\ntoken_file = %q\npoll_interval = \"100ms\"\n%s", srv.URL(), tok, extra))
}

// openTest opens a source of the table's settings, logging to a buffer that
// is shown if the test fails.
func openTest(t *testing.T, table string) (*Source, *testlog.Buffer) {
	t.Helper()
	logs := &testlog.Buffer{}
	src, err := New("v", decode(t, table), slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		src.Close()
		if t.Failed() {
			t.Logf("source log:\n%s", logs)
		}
	})
	return src, logs
}

// TestKVv2 follows a KV v2 folder and one secret through put, patch,
// delete, undelete and destroy: one file per field, below the secret's
// path for a folder; fields that are not strings as their JSON.
func TestKVv2(t *testing.T) {
	srv := vaulttest.Start(t)
	ctx := context.Background()
	kv := srv.Client(t).KVv2("secret")
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p1"})
	srv.Put(t, "secret", "app/cache/redis", map[string]any{"port": 6379, "tls": true, "opts": map[string]any{"a": "b"}})
	srv.Put(t, "secret", "other/x", map[string]any{"k": "v"})
	src, _ := tokenSource(t, srv, "")

	folder := sourcetest.Follow(t, src, "secret/app/")
	one := sourcetest.Follow(t, src, "secret/app/db")
	folder.WaitFor(t, "the folder", sourcetest.Holds(map[string]string{
		"db/user": "ada", "db/password": "p1",
		"cache/redis/port": "6379", "cache/redis/tls": "true", "cache/redis/opts": `{"a":"b"}`,
	}))
	one.WaitFor(t, "the secret", sourcetest.Holds(map[string]string{"user": "ada", "password": "p1"}))

	if _, err := kv.Patch(ctx, "app/db", map[string]any{"password": "p2"}); err != nil {
		t.Fatal(err)
	}
	one.WaitFor(t, "the patch", sourcetest.Holds(map[string]string{"user": "ada", "password": "p2"}))
	last := sourcetest.Last(mustSnaps(one))
	if last.Revision != "v2" {
		t.Errorf("revision %q; want v2", last.Revision)
	}
	db := last.Secrets["secret/data/app/db"]
	if db == nil || last.Secrets["secret/app/db"] != db {
		t.Fatalf("secrets %v; want the secret by both of its paths", last.Secrets)
	}
	if data, _ := db.Data["data"].(map[string]any); data["password"] != "p2" {
		t.Errorf("template data %v", db.Data)
	}

	if err := kv.Delete(ctx, "app/db"); err != nil {
		t.Fatal(err)
	}
	one.WaitFor(t, "the delete", sourcetest.Missing)
	folder.WaitFor(t, "the delete", sourcetest.Holds(map[string]string{"cache/redis/port": "6379", "cache/redis/tls": "true", "cache/redis/opts": `{"a":"b"}`}))
	if err := kv.Undelete(ctx, "app/db", []int{2}); err != nil {
		t.Fatal(err)
	}
	one.WaitFor(t, "the undelete", sourcetest.Holds(map[string]string{"user": "ada", "password": "p2"}))
	if err := kv.Destroy(ctx, "app/db", []int{2}); err != nil {
		t.Fatal(err)
	}
	one.WaitFor(t, "the destroy", sourcetest.Missing)
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p3"})
	one.WaitFor(t, "a new version", sourcetest.Holds(map[string]string{"user": "ada", "password": "p3"}))
	if err := kv.DeleteMetadata(ctx, "app/db"); err != nil {
		t.Fatal(err)
	}
	one.WaitFor(t, "the metadata's deletion", sourcetest.Missing)
}

// mustSnaps returns the snapshots rec recorded.
func mustSnaps(rec *sourcetest.Recorder) []source.Snapshot {
	snaps, _ := rec.State()
	return snaps
}

// TestConfigWarnings: kvmount check warns about credential files others
// can read, a plain http address elsewhere than loopback, and a Vault
// projection into a disk mount.
func TestConfigWarnings(t *testing.T) {
	dir := t.TempDir()
	readable := filepath.Join(dir, "token")
	if err := os.WriteFile(readable, []byte("t\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse("test.toml", []byte(fmt.Sprintf("[sources.v]\ntype = \"vault\"\naddress = \"http://vault.example:8200\"\ntoken_file = %q\n\n[[mount]]\nname = \"m\"\ndir = \"/srv/m\"\nsource = \"v\"\nprefix = \"secret/m/\"\n", readable)), map[string]config.SourceDecoder{"vault": Decode})
	if err != nil {
		t.Fatal(err)
	}
	var all []string
	for _, w := range cfg.Warnings {
		all = append(all, w.Error())
	}
	text := strings.Join(all, "\n")
	for _, want := range []string{
		"test.toml:4: sources.v.token_file: " + readable + " holds a credential and is readable by every user",
		"test.toml:3: sources.v.address: credentials go to vault.example:8200 in clear text (http://)",
		"mount m is on disk",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("warnings:\n%s\nwant one with %q", text, want)
		}
	}
}

// TestCheckRefusesSecretsOutsideProjections: kvmount check refuses, at its
// line, a template's secret whose path no Vault projection of the mount
// holds, or whose parameters are not its PKI projection's; a path of the
// mount's projections, in either of a KV v2 secret's forms, passes.
func TestCheckRefusesSecretsOutsideProjections(t *testing.T) {
	tok := writeFile(t, t.TempDir(), "token", "t")
	file := writeFile(t, t.TempDir(), "db.tmpl", "a\nb\n{{ with secret \"kv/other/x\" }}{{ end }}\n")
	text := fmt.Sprintf(`[sources.v]
type = "vault"
address = "https://vault.example:8200"
token_file = %q

[[mount]]
name = "m"
dir = "/srv/m"
medium = "tmpfs"
keys_as_files = false

  [[mount.projections]]
  source = "v"
  prefix = "kv/team/app/"

  [[mount.projections]]
  source = "v"
    [mount.projections.pki]
    role = "pki/issue/web"
    common_name = "web.example.com"

  [[mount.templates]]
  path = "ok"
  text = '''{{ with secret "kv/team/data/app/db" }}{{ end }}{{ with secret "kv/data/team/app/db" }}{{ end }}
{{ with secret "kv/team/app/db" }}{{ end }}{{ with secret "pki/issue/web" "common_name=web.example.com" }}{{ end }}
{{ with secret (printf "kv/team/app/%%s" "x") }}{{ end }}'''

  [[mount.templates]]
  path = "bad"
  text = '''first line
{{ with secret "kv/team/other" }}{{ end }}
{{ with secret "pki/issue/web" "common_name=evil.example.com" }}{{ end }}'''

  [[mount.templates]]
  path = "file"
  file = %q
`, tok, file)
	_, err := config.Parse("test.toml", []byte(text), map[string]config.SourceDecoder{"vault": Decode})
	if err == nil {
		t.Fatal("no error")
	}
	got := err.Error()
	for _, want := range []string{
		`test.toml:31: mount[0].templates[1].text: template: secret "kv/team/other": no Vault projection of mount m holds it`,
		`test.toml:32: mount[0].templates[1].text: template: secret "pki/issue/web" common_name=evil.example.com: no [mount.pki] projection of mount m issues with these parameters`,
		`template: ` + file + `:3: secret "kv/other/x": no Vault projection of mount m holds it`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("errors:\n%s\nwant one with %q", got, want)
		}
	}
	if n := strings.Count(got, "\n") + 1; n != 3 {
		t.Errorf("%d errors; want 3 (the paths of the mount's projections pass):\n%s", n, got)
	}
}

// TestDecodeErrors: what a vault source and its projections refuse, at
// their lines.
func TestDecodeErrors(t *testing.T) {
	tok := writeFile(t, t.TempDir(), "token", "t")
	text := fmt.Sprintf(`[sources.v]
type = "vault"
address = "https://vault.example:8200/v1"
token_file = %q
change_detection = "watch"

[sources.none]
type = "vault"
address = "https://vault.example:8200"

[[mount]]
name = "a"
dir = "/srv/a"
medium = "tmpfs"
source = "v"
prefix = "secret/../x"

[[mount]]
name = "b"
dir = "/srv/b"
medium = "tmpfs"
immutable = true
source = "v"
  [mount.pki]
  role = "pki/web"
  ttl = "soon"

[[mount]]
name = "c"
dir = "/srv/c"
medium = "tmpfs"
source = "v"
`, tok)
	_, err := config.Parse("test.toml", []byte(text), map[string]config.SourceDecoder{"vault": Decode})
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{
		`test.toml:3: sources.v.address: "https://vault.example:8200/v1": want scheme, host and port only`,
		`test.toml:5: sources.v.change_detection: "watch": a vault source polls`,
		`test.toml:7: sources.none: no credentials: set token_file`,
		`test.toml:16: mount[0].prefix: "secret/../x": has an empty, "." or ".." element`,
		`test.toml:25: mount[1].pki.role: "pki/web": want the issue endpoint of a PKI role`,
		`test.toml:24: mount[1].pki: common_name is missing`,
		`test.toml:26: mount[1].pki.ttl: "soon": want a positive duration`,
		`mount[1].pki: mount b is immutable`,
		`mount[2]: prefix is missing`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("errors:\n%s\nwant one with %q", err, want)
		}
	}
}
