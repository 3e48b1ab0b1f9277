package privsep

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/config"
)

// TestDomains: the trust domains are the connected components of the
// sources and the mounts that project them; a source no mount uses is a
// domain of its own.
func TestDomains(t *testing.T) {
	mount := func(name string, sources ...string) *config.Mount {
		m := &config.Mount{Name: name}
		for _, s := range sources {
			m.Projections = append(m.Projections, config.Projection{Source: s})
		}
		return m
	}
	got := Domains([]*config.Mount{mount("a", "s1"), mount("b", "s2"), mount("c", "s3", "s2"), mount("d", "s5", "s3"), mount("e", "s1")},
		[]string{"s1", "s2", "s3", "s4", "s5"})
	want := map[string]Domain{
		"s1":       {Name: "s1", Sources: []string{"s1"}, Mounts: []string{"a", "e"}},
		"s2+s3+s5": {Name: "s2+s3+s5", Sources: []string{"s2", "s3", "s5"}, Mounts: []string{"b", "c", "d"}},
		"s4":       {Name: "s4", Sources: []string{"s4"}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Domains = %+v\nwant %+v", got, want)
	}
}

// fakeKinds decode sources of type "fake", which read a token_file.
var fakeKinds = map[string]config.SourceDecoder{"fake": func(sec *config.Section) any {
	return sec.SecretFile("token_file")
}}

// parseFake parses text as /etc/kvmount/kvmount.toml with fakeKinds, and
// returns it and what the monitor read for it (its inputs, the text
// included).
func parseFake(t *testing.T, text string) (*config.Config, map[string][]byte) {
	t.Helper()
	rec := &config.Recorder{}
	cfg, err := config.ParseWith("/etc/kvmount/kvmount.toml", []byte(text), fakeKinds, rec)
	if err != nil {
		t.Fatal(err)
	}
	inputs := rec.Recorded()
	inputs[cfg.Path] = cfg.Text
	return cfg, inputs
}

// TestDomainConfiguration: a domain's worker is given the text of its
// sources and mounts alone, and the files that text names — never
// another domain's credential file.
func TestDomainConfiguration(t *testing.T) {
	dir := t.TempDir()
	one, two := filepath.Join(dir, "one.token"), filepath.Join(dir, "two.token")
	for _, f := range []string{one, two} {
		if err := os.WriteFile(f, []byte("secret of "+f), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cfg, inputs := parseFake(t, "[sources.one]\ntype = \"fake\"\ntoken_file = \""+one+"\"\n"+
		"[sources.two]\ntype = \"fake\"\ntoken_file = \""+two+"\"\n"+
		"[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"one\"\n"+
		"[[mount]]\nname = \"b\"\ndir = \"/srv/b\"\nsource = \"two\"\n")
	domains := ConfigDomains(cfg)
	c, part, err := DomainConfiguration(cfg, inputs, fakeKinds, domains["one"])
	if err != nil {
		t.Fatal(err)
	}
	if names := slices.Sorted(maps.Keys(c.Inputs)); !slices.Equal(names, []string{cfg.Path, one}) {
		t.Errorf("domain one is given %v; want the configuration and %s", names, one)
	}
	if strings.Contains(string(c.Inputs[cfg.Path]), two) || strings.Contains(string(c.Inputs[cfg.Path]), "/srv/b") {
		t.Errorf("domain one's configuration names domain two's:\n%s", c.Inputs[cfg.Path])
	}
	if len(part.Mounts) != 1 || part.Mounts[0].Name != "a" || len(c.Mounts) != 1 || c.Mounts["a"].MaxFiles == 0 {
		t.Errorf("domain one's mounts: %+v, limits %+v", part.Mounts, c.Mounts)
	}
	if got := domains["one"].Of(cfg); len(got.Sources) != 1 || got.Sources["one"] == nil || len(got.Mounts) != 1 {
		t.Errorf("Of: %+v", got)
	}
	// A file the monitor did not read is an error, not a silent gap.
	delete(inputs, one)
	if _, _, err := DomainConfiguration(cfg, inputs, fakeKinds, domains["one"]); err == nil {
		t.Error("no error for a share whose file the monitor did not read")
	}
}

// TestDomainConfigurationOfEverything: the only domain, which holds every
// source and mount, is given the configuration as the monitor read it —
// its text byte for byte, comments and lines kept, and every file it
// names — and its share is the configuration itself. A domain that lacks
// one mount is given an excerpt.
func TestDomainConfigurationOfEverything(t *testing.T) {
	dir := t.TempDir()
	token := filepath.Join(dir, "one.token")
	if err := os.WriteFile(token, []byte("secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	text := "# the operator's note\n[sources.one]\ntype = \"fake\"\ntoken_file = \"" + token + "\"\n" +
		"[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"one\"\n" +
		"[[mount]]\nname = \"b\"\ndir = \"/srv/b\"\nsource = \"one\"\n"
	cfg, inputs := parseFake(t, text)
	domains := ConfigDomains(cfg)
	if len(domains) != 1 {
		t.Fatalf("%d domains; want 1", len(domains))
	}
	for _, d := range domains {
		c, part, err := DomainConfiguration(cfg, inputs, fakeKinds, d)
		if err != nil {
			t.Fatal(err)
		}
		if string(c.Inputs[cfg.Path]) != text || string(c.Inputs[token]) != "secret" || len(c.Inputs) != 2 {
			t.Errorf("the only domain is given %q; want the configuration as read and its token file", c.Inputs)
		}
		if part != cfg || len(c.Mounts) != 2 {
			t.Errorf("the only domain's share: %p (want the configuration, %p), limits of %d mounts", part, cfg, len(c.Mounts))
		}
		d.Mounts = d.Mounts[:1]
		c, part, err = DomainConfiguration(cfg, inputs, fakeKinds, d)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(c.Inputs[cfg.Path]), "operator's note") || len(part.Mounts) != 1 {
			t.Errorf("a domain of one mount of two is given:\n%s", c.Inputs[cfg.Path])
		}
	}
}

// BenchmarkDomainConfiguration1000Mounts measures what a start spends on
// the configuration of BenchmarkScale100kKeys' daemon (one etcd source,
// 1,000 mounts, one trust domain): the monitor's parse of the file, then
// its domain's excerpt and the parse of that excerpt (DomainConfiguration).
func BenchmarkDomainConfiguration1000Mounts(b *testing.B) {
	var text strings.Builder
	text.WriteString("state_dir = \"/var/lib/kvmount\"\n[sources.main]\ntype = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n")
	for m := range 1000 {
		fmt.Fprintf(&text, "[[mount]]\nname = \"m%04d\"\ndir = \"/srv/kv/m%04d\"\nsource = \"main\"\nprefix = \"/scale/m%04d/\"\n", m, m, m)
	}
	data := []byte(text.String())
	const path = "/etc/kvmount/kvmount.toml"
	b.ReportAllocs()
	for b.Loop() {
		rec := &config.Recorder{}
		cfg, err := config.ParseWith(path, data, kinds, rec)
		if err != nil {
			b.Fatal(err)
		}
		inputs := rec.Recorded()
		inputs[cfg.Path] = cfg.Text
		for _, d := range ConfigDomains(cfg) {
			if _, _, err := DomainConfiguration(cfg, inputs, kinds, d); err != nil {
				b.Fatal(err)
			}
		}
	}
}
