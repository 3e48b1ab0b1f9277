package projector

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/render"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

func keys(kv ...string) map[string][]byte {
	m := map[string][]byte{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = []byte(kv[i+1])
	}
	return m
}

// TestTemplateFunctions renders each function over a fixed key set.
func TestTemplateFunctions(t *testing.T) {
	k := keys("a", "1", "dir/b", "2", "dir/c", "3", "dir/sub/d", "4", "other", "x")
	tests := []struct{ text, want string }{
		{`{{ key "a" }}`, "1"},
		{`{{ key "./dir//b" }}`, "2"},
		{`{{ keyOrDefault "missing" "def" }}|{{ keyOrDefault "a" "def" }}`, "def|1"},
		{`{{ keyExists "a" }} {{ keyExists "nope" }}`, "true false"},
		{`{{ range ls "dir" }}{{ .Key }}={{ .Value }} {{ end }}`, "b=2 c=3 "},
		{`{{ range tree "dir" }}{{ .Key }}={{ .Value }} {{ end }}`, "b=2 c=3 sub/d=4 "},
		{`{{ range ls "" }}{{ .Key }} {{ end }}`, "a other "},
		{`{{ len (tree "") }}`, "5"},
		{`{{ key "a" | toUpper }}{{ "x,y" | split "," | join "+" }}{{ sprig_repeat 3 "z" }}`, "1x+yzzz"},
		{`{{ range ls "nothing" }}x{{ end }}none`, "none"},
	}
	for _, tt := range tests {
		tmpl, err := ParseTemplate("t", "out", tt.text, 0)
		if err != nil {
			t.Fatalf("ParseTemplate(%s): %v", tt.text, err)
		}
		got, _, err := tmpl.Render(k, 0)
		if err != nil || string(got) != tt.want {
			t.Errorf("%s = %q, %v; want %q", tt.text, got, err, tt.want)
		}
	}
}

// TestTemplateIsHermetic: nothing reads the environment, the clock,
// randomness, files or the network: such functions are refused when the
// template is parsed (kvmount check reports it at its line); sprig's bare
// names are not defined, with a hint.
func TestTemplateIsHermetic(t *testing.T) {
	for _, text := range []string{`{{ env "HOME" }}`, `{{ sprig_expandenv "$HOME" }}`, `{{ timestamp }}`, `{{ sprig_now }}`, `{{ sprig_randInt 0 9 }}`,
		`{{ sprig_uuidv4 }}`, `{{ sprig_getHostByName "x" }}`, `{{ file "/etc/passwd" }}`, `{{ sprig_htpasswd "u" "p" }}`} {
		if _, err := ParseTemplate("t", "out", text, 0); !errors.Is(err, render.ErrRefused) {
			t.Errorf("%s parsed: %v; want it refused", text, err)
		}
	}
	if _, err := ParseTemplate("t", "out", `{{ upper "x" }}`, 0); err == nil || !strings.Contains(err.Error(), "did you mean toUpper, or sprig_upper?") {
		t.Errorf("a bare sprig name: %v; want a hint", err)
	}
}

// TestTemplateErrors: a missing key names the key and the template; too
// much output is stopped; a bad path is refused.
func TestTemplateErrors(t *testing.T) {
	tmpl, _ := ParseTemplate("/etc/kvmount/app.tmpl", "app.conf", `port {{ key "port" }}`, 0)
	_, _, err := tmpl.Render(keys("a", "1"), 0)
	if !errors.Is(err, ErrTemplate) || !strings.Contains(err.Error(), "/etc/kvmount/app.tmpl") || !strings.Contains(err.Error(), `key "port" does not exist`) {
		t.Errorf("missing key: %v", err)
	}
	big, _ := ParseTemplate("big", "big.conf", `{{ range loop 100000 }}xxxxxxxxxx{{ end }}`, 0)
	if _, _, err := big.Render(nil, 1024); err == nil || !strings.Contains(err.Error(), "exceeds max_value_size (1024 bytes)") {
		t.Errorf("too much output: %v", err)
	}
	if _, err := ParseTemplate("t", "../escape", "x", 0); !errors.Is(err, ErrInvalidPath) {
		t.Errorf("path ../escape: %v", err)
	}
	if _, err := ParseTemplate("t", "..data/x", "x", 0); !errors.Is(err, ErrInvalidPath) {
		t.Errorf("path ..data/x: %v", err)
	}
}

// TestTemplateGolden renders an nginx upstream template (testdata/),
// compared with its golden file; -update rewrites it.
func TestTemplateGolden(t *testing.T) {
	text, err := os.ReadFile("testdata/nginx-upstream.tmpl")
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := ParseTemplate("testdata/nginx-upstream.tmpl", "nginx.conf", string(text), 0)
	if err != nil {
		t.Fatal(err)
	}
	got, read, err := tmpl.Render(keys(
		"name", "app",
		"backends/a", "10.0.0.1:8080", "backends/b", "10.0.0.2:8080", "backends/c", "10.0.0.3:8080",
		"weights/b", "5", "port", "8443",
		"headers/X/Forwarded/Proto", "https", "headers/Host", "$host",
	), 0)
	if err != nil {
		t.Fatal(err)
	}
	golden := filepath.Join("testdata", "nginx-upstream.golden")
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("rendered:\n%s\nwant (testdata/nginx-upstream.golden, -update to rewrite):\n%s", got, want)
	}
	if !read["name"] || !read["backends/"] || !read["weights/b"] || !read["headers/"] {
		t.Errorf("read set %v lacks the keys and listings the template used", read)
	}
}

// TestMakePayloadWithTemplates: rendered files join the payload with their
// mode; keys_as_files = false keeps the keys out; a rendered path on a
// key's path fails the mount naming both; a render error fails the mount.
func TestMakePayloadWithTemplates(t *testing.T) {
	conf, _ := ParseTemplate("conf.tmpl", "conf/app.conf", `a={{ key "a" }} b={{ key "dir/b" }}`, 0o600)
	pr := []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1"), "dir/b": []byte("2")})}}
	opts := Options{Mode: 0o644, UID: 7, GID: 8, Templates: []*Template{conf}}
	got, _, err := MakePayload("m", pr, opts)
	if err != nil {
		t.Fatal(err)
	}
	want := Payload{"a": {Data: []byte("1"), Mode: 0o644, UID: 7, GID: 8}, "dir/b": {Data: []byte("2"), Mode: 0o644, UID: 7, GID: 8},
		"conf/app.conf": {Data: []byte("a=1 b=2"), Mode: 0o600, UID: 7, GID: 8}}
	if !got.Equal(want) {
		t.Errorf("payload %v; want %v", describe(got), describe(want))
	}
	opts.KeysOnlyForTemplates = true
	if got, _, _ := MakePayload("m", pr, opts); len(got) != 1 || string(got["conf/app.conf"].Data) != "a=1 b=2" {
		t.Errorf("keys for templates only: %v", describe(got))
	}
	clash, _ := ParseTemplate("clash.tmpl", "a", "x", 0)
	if _, _, err := MakePayload("m", pr, Options{Mode: 0o644, Templates: []*Template{clash}}); err == nil || !strings.Contains(err.Error(), `template clash.tmpl renders "a", which is also the path of key "/p/a"`) {
		t.Errorf("template on a key's path: %v", err)
	}
	below, _ := ParseTemplate("below.tmpl", "a/x", "x", 0)
	if _, _, err := MakePayload("m", pr, Options{Mode: 0o644, Templates: []*Template{below}}); err == nil || !strings.Contains(err.Error(), `lies below file "a"`) {
		t.Errorf("template below a key's file: %v", err)
	}
	missing, _ := ParseTemplate("missing.tmpl", "m.conf", `{{ key "nope" }}`, 0)
	if _, _, err := MakePayload("m", pr, Options{Mode: 0o644, Templates: []*Template{missing}}); !errors.Is(err, ErrTemplate) || !strings.Contains(err.Error(), `mount "m"`) {
		t.Errorf("render error: %v", err)
	}
}

// FuzzTemplate parses and renders fuzzed template text against a fixed key
// set: it never panics, and the payload holds the keys and the one
// rendered path, nothing else.
func FuzzTemplate(f *testing.F) {
	for _, seed := range []string{`{{ key "a" }}`, `{{ range tree "" }}{{ .Key }}{{ end }}`, `{{ ls "d" }}`, `{{ define "x" }}{{ template "x" }}{{ end }}`, `{{ keyOrDefault "a" }}`, `{{ . }}`, `{{ index . 1 }}`} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, text string) {
		tmpl, err := ParseTemplate("fuzz", "out.conf", text, 0)
		if err != nil {
			return
		}
		pr := []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1"), "d/b": []byte("2")})}}
		payload, _, err := MakePayload("m", pr, Options{Mode: 0o644, MaxValueSize: 1 << 16, Templates: []*Template{tmpl}})
		if err != nil {
			return
		}
		for p := range payload {
			if p != "a" && p != "d/b" && p != "out.conf" {
				t.Fatalf("template %q produced path %q", text, p)
			}
		}
	})
}

// BenchmarkRender renders a template that lists every key of a mount of
// 1,000 and of 10,000 keys (no cache: every iteration renders).
func BenchmarkRender(b *testing.B) {
	tmpl, err := ParseTemplate("bench", "all.conf", "{{ range tree \"\" }}{{ .Key }} {{ .Value }}\n{{ end }}", 0)
	if err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			k := map[string][]byte{}
			for i := range n {
				k[fmt.Sprintf("dir%02d/key-%05d", i%50, i)] = []byte(fmt.Sprintf("value %d, padded to look like a small config line", i))
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := tmpl.Render(k, 0); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
