package daemon

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/testbin"
	"github.com/kvmount/kvmount/internal/vaulttest"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/source"
	"github.com/kvmount/kvmount/source/consul"
	"github.com/kvmount/kvmount/source/vault"
)

// consulTemplateBinary returns consul-template: $KVMOUNT_CONSUL_TEMPLATE,
// else the build scripts/consul-template.sh caches. Without one the test
// is skipped — or fails when CI=true.
func consulTemplateBinary(t testing.TB) string {
	t.Helper()
	return testbin.Binary{What: "consul-template", Env: "KVMOUNT_CONSUL_TEMPLATE", Dir: "consul-template-v0.42.1", Name: "consul-template", Script: "scripts/consul-template.sh"}.Find(t)
}

// parityKeys is the Consul data set both tools render: services,
// configuration folders, JSON and YAML values, Consul folder markers, an
// empty value.
var parityKeys = []string{
	"service/web/", "",
	"service/web/name", "web",
	"service/web/keepalive", "",
	"service/web/backends/web1", "10.0.0.1:8080",
	"service/web/backends/web2", "10.0.0.2:8080",
	"service/web/backends/web3", "10.0.0.3:8080",
	"service/web/weights/web2", "5",
	"haproxy/servers/s1", "10.1.0.1",
	"haproxy/servers/s2", "10.1.0.2",
	"config/app/name", "My App",
	"config/app/features", "alpha,beta,gamma",
	"config/app/db/host", "db.internal",
	"config/app/db/port", "5432",
	"config/app/db/dsn", "postgres://u@db?sslmode=require&x=<y>",
	"config/app/cache/ttl", "60s",
	"config/app/json", `{"name":"ada","tags":["x","y"],"nested":{"k":1,"b":true}}`,
	"config/app/yaml", "name: ada\nlist:\n  - 1\n  - 2\nmap:\n  a: b\n",
	"overrides/app/db/host", "db2.internal",
	"overrides/app/extra", "yes",
	"groups/elasticsearch/es1", "1",
	"groups/elasticsearch/es2", "1",
	"groups/redis/r1", "2",
	"text/multi", "line one\n\nline three\n",
	"text/b64", "aGVsbG8=",
	"numbers/a", "7",
	"numbers/b", "3",
}

// parityTemplates are realistic templates of consul-template users,
// outside its documented differences from kvmount (a missing key, ls of a
// name that is a prefix of others, the catalog).
var parityTemplates = map[string]string{
	"nginx-upstream": `upstream {{ key "service/web/name" }} {
{{- range ls "service/web/backends" }}
    server {{ .Value }}{{ if keyExists (printf "service/web/weights/%s" .Key) }} weight={{ key (printf "service/web/weights/%s" .Key) }}{{ end }};
{{- end }}
    keepalive {{ keyOrDefault "service/web/keepalive" "16" }};
}
`,
	"haproxy-backend": `backend app
    balance roundrobin
{{- range $i, $s := ls "haproxy/servers" }}
    server {{ $s.Key }} {{ $s.Value }}:80 check id {{ add $i 1 }}
{{- end }}
`,
	"tree-paths":     `{{ range tree "config/app" }}{{ .Path }} {{ .Key }}={{ .Value }}` + "\n" + `{{ end }}`,
	"explode-json":   `{{ tree "config/app/db" | explode | toJSON }}`,
	"explode-pretty": `{{ tree "config/app" | explode | toJSONPretty }}`,
	"explode-yaml":   `{{ tree "config/app/db" | explode | toYAML }}`,
	"explode-toml":   `{{ tree "config/app/db" | explode | toTOML }}`,
	"unescaped-json": `{{ tree "config/app/db" | explode | toUnescapedJSON }}|{{ tree "config/app/db" | explode | toUnescapedJSONPretty }}`,
	"parse-json":     `{{ with key "config/app/json" | parseJSON }}{{ .name }} {{ range .tags }}{{ . }},{{ end }} {{ .nested.k }} {{ .nested.b }}{{ end }}`,
	"parse-yaml":     `{{ with key "config/app/yaml" | parseYAML }}{{ .name }} {{ range .list }}{{ . }};{{ end }} {{ .map.a }}{{ end }}`,
	"split-join":     `{{ range key "config/app/features" | split "," }}[{{ . }}]{{ end }} {{ key "config/app/features" | split "," | join " + " }}`,
	"strings":        `{{ key "config/app/name" | toUpper }} {{ key "config/app/name" | toLower }} {{ "my app name" | toTitle }} {{ "  x  " | trimSpace }} {{ "--x--" | trim "-" }} {{ "a.b.c" | replaceAll "." "_" }} {{ "foo.bar" | regexReplaceAll "foo([.a-z]+)" "$1" }} {{ "foo.bar" | regexMatch "^foo" }} {{ "prefix-x" | trimPrefix "prefix-" }} {{ "x.conf" | trimSuffix ".conf" }}`,
	"indent":         "db:\n{{ tree \"config/app/db\" | explode | toYAML | indent 4 }}\n---\n{{ key \"text/multi\" | indent 2 }}",
	"whitespace":     "servers:{{- range ls \"service/web/backends\" -}}\n  {{ .Key }}\n{{- end }}\ndone\n",
	"printf":         `{{ range ls "service/web/backends" }}{{ printf "%-8s|%20s|%q" .Key .Value .Value }}` + "\n" + `{{ end }}`,
	"math":           `{{ key "numbers/a" | parseInt | add 2 }} {{ key "numbers/a" | parseInt | subtract 2 }} {{ 5 | subtract 2 }} {{ 10 | divide 2 }} {{ 7 | modulo 3 }} {{ multiply 3 4 }} {{ minimum 2 5 }} {{ maximum 2 5 }} {{ add 1.5 2 }} {{ key "numbers/b" | parseInt | multiply (key "numbers/a" | parseInt) }}`,
	"by-key":         `{{ range $group, $pairs := tree "groups" | byKey }}{{ $group }}:{{ range $pairs }} {{ .Key }}={{ .Value }}{{ end }}` + "\n" + `{{ end }}`,
	"exists-default": `{{ keyExists "service/web/" }} {{ keyExists "service/web/name" }} {{ keyExists "nope" }} {{ keyOrDefault "service/web/keepalive" "default" }} {{ keyOrDefault "nope" "d2" }} {{ keyOrDefault "service/web/name" "d3" }}`,
	"scratch":        `{{ scratch.Set "a" "1" }}{{ scratch.SetX "a" "2" }}{{ scratch.Get "a" }} {{ range ls "service/web/backends" }}{{ scratch.MapSet "b" .Key .Value }}{{ end }}{{ range scratch.MapValues "b" }}{{ . }} {{ end }}{{ scratch.Key "b" }}`,
	"execute":        `{{ define "line" }}server {{ .Value }};{{ end }}{{ range ls "service/web/backends" }}{{ executeTemplate "line" . }}` + "\n" + `{{ end }}`,
	"contains":       `{{ $f := key "config/app/features" | split "," }}{{ if $f | contains "beta" }}has beta{{ end }} {{ in $f "zeta" }} {{ containsAny (sprig_list "zeta" "gamma") $f }} {{ containsAll (sprig_list "alpha" "gamma") $f }} {{ containsNone (sprig_list "zeta") $f }} {{ containsNotAll (sprig_list "alpha" "zeta") $f }}`,
	"encodings":      `{{ key "text/b64" | base64Decode }} {{ "hello" | base64Encode }} {{ "hello?>" | base64URLEncode }} {{ "aGVsbG8_Pg==" | base64URLDecode }} {{ "x" | sha256Hex }} {{ "x" | md5sum }} {{ hmacSHA256Hex "message" "key" }}`,
	"merge":          `{{ $base := tree "config/app" | explode }}{{ $o := tree "overrides/app" | explode | mergeMapWithOverride $base }}{{ with $o.db }}{{ .host }} {{ .port }}{{ end }} {{ $o.extra }}|{{ $b := tree "config/app" | explode }}{{ $m := tree "overrides/app" | explode | mergeMap $b }}{{ with $m.db }}{{ .host }}{{ end }} {{ $m.extra }}`,
	"sprig":          `{{ "hello" | sprig_upper }} {{ sprig_list 1 2 3 | sprig_join "-" }} {{ "a b" | sprig_replace " " "_" }} {{ sprig_default "d" "" }} {{ "abc" | sprig_trunc 2 }}`,
	"loop":           `{{ range $i := loop 3 }}{{ $i }}{{ end }} {{ range loop 2 5 }}{{ . }}{{ end }} {{ range loop (key "numbers/b" | parseInt) }}x{{ end }}`,
	"split-to-map":   `{{ $m := "a:1,b:2,c" | splitToMap "," ":" }}{{ $m.a }}{{ $m.b }} {{ "true" | parseBool }} {{ "1.5" | parseFloat }} {{ "42" | parseUint }} {{ "" | parseInt }}`,
	"explode-map":    `{{ range tree "config/app/db" }}{{ scratch.MapSet "flat" (printf "db/%s" .Key) .Value }}{{ end }}{{ scratch.Get "flat" | explodeMap | toJSON }}`,
}

// TestConsulTemplateParity renders realistic templates with consul-template
// v0.42.1 (built from its module) and with kvmount render, against one
// real Consul agent, and requires the same bytes — the review found five
// templates silently different, from sprig's functions under
// consul-template's names.
func TestConsulTemplateParity(t *testing.T) {
	ct := consulTemplateBinary(t)
	agent := consultest.Start(t)
	consultest.Txn(t, agent.Client(), parityKeys...)
	dir := t.TempDir()
	kvTemplates := renderWithConsulTemplate(t, ct, dir, parityTemplates, "-consul-addr", agent.Addr())
	// kvmount render of one mount holding every template.
	cfg := filepath.Join(dir, "kvmount.toml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`state_dir = %q
[sources.c]
type = "consul"
address = %q

[[mount]]
name = "m"
dir = %q
source = "c"
prefix = ""
keys_as_files = false
%s`, filepath.Join(dir, "state"), agent.URL(), filepath.Join(dir, "mnt"), kvTemplates)), 0o644); err != nil {
		t.Fatal(err)
	}
	payload, err := Render(context.Background(), Options{ConfigPath: cfg, Registry: source.NewRegistry(consul.Kind()), LogOutput: os.Stderr}, "m", waitTimeout)
	if err != nil {
		t.Fatalf("kvmount render: %v", err)
	}
	compareRenders(t, dir, payload, parityTemplates)

}

// parityVaultTemplates are templates of consul-template and vault-agent
// users that read Vault with secret: KV v2 by its API path and by the
// path consul-template completes with data/, KV v1, fields that are not
// strings, the metadata, the lease.
var parityVaultTemplates = map[string]string{
	"kv2-fields":   `{{ with secret "secret/data/app/db" }}postgres://{{ .Data.data.user }}:{{ .Data.data.password }}@db:{{ .Data.data.port }}?ssl={{ .Data.data.ssl }}{{ end }}`,
	"kv2-shim":     `{{ with secret "secret/app/db" }}{{ .Data.data.user }} v{{ .Data.metadata.version }} {{ .Data.metadata.destroyed }} {{ .Data.metadata.custom_metadata }}{{ end }}`,
	"kv2-range":    `{{ with secret "secret/data/app/db" }}{{ range $k, $v := .Data.data }}{{ $k }}={{ $v }};{{ end }}{{ end }}`,
	"kv2-json":     `{{ with secret "secret/data/app/db" }}{{ .Data.data | toJSON }}|{{ .Data.data.opts.pool }}|{{ .Data.data.tags }}{{ end }}`,
	"kv2-yaml":     `{{ with secret "secret/data/app/db" }}{{ .Data.data | toYAML }}{{ end }}`,
	"kv2-env":      `{{ with secret "secret/data/app/env" }}{{ range $k, $v := .Data.data }}export {{ $k | toUpper }}={{ $v | printf "%q" }}` + "\n" + `{{ end }}{{ end }}`,
	"kv1":          `{{ with secret "kv1/app/api" }}{{ .Data.key }} {{ .LeaseDuration }} {{ .Renewable }} {{ .LeaseID }}{{ end }}`,
	"kv-scratch":   `{{ with secret "secret/data/app/db" }}{{ scratch.Set "u" .Data.data.user }}{{ end }}{{ with secret "kv1/app/api" }}{{ scratch.Get "u" }}:{{ .Data.key }}{{ end }}`,
	"kv2-base64":   `{{ with secret "secret/data/app/env" }}{{ .Data.data.blob | base64Decode }}{{ end }}`,
	"kv2-optional": `{{ with secret "secret/data/app/db" }}{{ if index .Data.data "missing_field" }}yes{{ else }}no{{ end }}{{ end }}`,
}

// TestConsulTemplateVaultParity renders the Vault templates with
// consul-template v0.42.1 and with kvmount render, against one real Vault
// dev server, and requires the same bytes.
func TestConsulTemplateVaultParity(t *testing.T) {
	ct := consulTemplateBinary(t)
	srv := vaulttest.Start(t)
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p@ss w0rd", "port": 5432, "ssl": true,
		"opts": map[string]any{"pool": 10}, "tags": []any{"a", "b"}})
	srv.Put(t, "secret", "app/env", map[string]any{"db_host": "db.internal", "api_url": "https://x/?a=1&b=2", "blob": "aGVsbG8="})
	srv.Write(t, "sys/mounts/kv1", map[string]any{"type": "kv", "options": map[string]any{"version": "1"}})
	srv.Write(t, "kv1/app/api", map[string]any{"key": "k-123"})
	dir := t.TempDir()
	kvTemplates := renderWithConsulTemplate(t, ct, dir, parityVaultTemplates,
		"-vault-addr", srv.URL(), "-vault-token", vaulttest.RootToken, "-vault-renew-token=false")
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte(vaulttest.RootToken), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "kvmount.toml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`state_dir = %q
[sources.v]
type = "vault"
address = %q
token_file = %q

[[mount]]
name = "m"
dir = %q
medium = "tmpfs"
keys_as_files = false

  [[mount.projections]]
  source = "v"
  prefix = "secret/app/"

  [[mount.projections]]
  source = "v"
  prefix = "kv1/app/api"

%s`, filepath.Join(dir, "state"), srv.URL(), token, filepath.Join(dir, "mnt"), kvTemplates)), 0o644); err != nil {
		t.Fatal(err)
	}
	payload, err := Render(context.Background(), Options{ConfigPath: cfg, Registry: source.NewRegistry(vault.Kind()), LogOutput: os.Stderr}, "m", waitTimeout)
	if err != nil {
		t.Fatalf("kvmount render: %v", err)
	}
	compareRenders(t, dir, payload, parityVaultTemplates)
}

// renderWithConsulTemplate writes templates (name → text) into dir and
// renders them once with consul-template ct, given the flags that name its
// server, with no environment of ours, into dir/ct/NAME; it returns the
// [[mount.templates]] tables of a kvmount mount that renders the same
// files.
func renderWithConsulTemplate(t *testing.T, ct, dir string, templates map[string]string, serverFlags ...string) string {
	t.Helper()
	args := append(slices.Clone(serverFlags), "-once", "-log-level", "err")
	var tables strings.Builder
	for name, text := range templates {
		in := filepath.Join(dir, name+".tmpl")
		if err := os.WriteFile(in, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "-template", in+":"+filepath.Join(dir, "ct", name))
		fmt.Fprintf(&tables, "  [[mount.templates]]\n  path = %q\n  file = %q\n", name, in)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, ct, args...)
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + dir}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("consul-template: %v\n%s", err, out)
	}
	return tables.String()
}

// compareRenders requires kvmount's payload to hold, for every template,
// the bytes consul-template rendered into dir/ct/NAME.
func compareRenders(t *testing.T, dir string, payload projector.Payload, templates map[string]string) {
	t.Helper()
	for name := range templates {
		want, err := os.ReadFile(filepath.Join(dir, "ct", name))
		if err != nil {
			t.Fatalf("%s: consul-template rendered nothing: %v", name, err)
		}
		if got := string(payload[name].Data); got != string(want) {
			t.Errorf("%s: kvmount rendered\n%q\nconsul-template\n%q", name, got, want)
		}
	}
	t.Logf("%d templates rendered the same bytes in consul-template v0.42.1 and kvmount", len(templates))
}
