package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestReplayDecodesTheSameConfiguration: what a Recorder kept while the
// monitor loaded a configuration — a credential file, a TLS pair, a
// template file — is enough for Replay to decode the very same
// configuration where none of those files can be read (the worker), and a
// file it does not hold is an error naming it.
func TestReplayDecodesTheSameConfiguration(t *testing.T) {
	kinds := map[string]SourceDecoder{"fake": func(sec *Section) any {
		return struct {
			TLS   TLS
			Token Secret
		}{sec.TLS("tls"), sec.SecretFile("token_file")}
	}}
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	token := filepath.Join(dir, "token")
	tmpl := filepath.Join(dir, "app.tmpl")
	for name, body := range map[string]string{token: "s3cret\n", tmpl: "{{ range ls \"app\" }}{{ .Key }}{{ end }}\n"} {
		if err := os.WriteFile(name, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	text := fmt.Sprintf(`
[sources.s]
type = "fake"
token_file = %q
tls = { ca_file = %q, cert_file = %q, key_file = %q }

[[mount]]
name = "app"
dir = "/srv/app"
keys_as_files = false
source = "s"
prefix = "app/"
templates = [{ path = "app.conf", file = %q }]
`, token, cert, cert, key, tmpl)
	path := filepath.Join(dir, "kvmount.toml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	rec := &Recorder{}
	want, err := LoadWith(path, kinds, rec)
	if err != nil {
		t.Fatal(err)
	}
	copies := rec.Recorded()
	for _, name := range []string{token, cert, key, tmpl} {
		if _, ok := copies[name]; !ok {
			t.Errorf("the recorder kept no copy of %s; kept %d files", name, len(copies))
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	got, err := ParseWith(path, want.Text, kinds, Replay(copies))
	if err != nil {
		t.Fatalf("parsing the copies: %v", err)
	}
	got.Warnings, want.Warnings = nil, nil
	// Parsed templates hold their parse trees: compared by what they
	// were parsed from.
	for i, m := range got.Mounts {
		w := want.Mounts[i]
		if len(m.Templates) != 1 || len(w.Templates) != 1 || m.Templates[0].Path != w.Templates[0].Path || m.Templates[0].Origin != w.Templates[0].Origin {
			t.Fatalf("mount %q's templates differ: %+v, want %+v", m.Name, m.Templates, w.Templates)
		}
		m.Templates, w.Templates = nil, nil
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("the configuration decoded from the copies differs:\n got %+v\nwant %+v", got, want)
	}
	delete(copies, token)
	if _, err := ParseWith(path, want.Text, kinds, Replay(copies)); err == nil || !strings.Contains(err.Error(), token) {
		t.Errorf("without the token file's copy: %v; want an error naming %s", err, token)
	}
	if _, err := ReadSecretFileFrom(Replay(copies), token); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ReadSecretFileFrom a replay without the file: %v; want os.ErrNotExist", err)
	}
}
