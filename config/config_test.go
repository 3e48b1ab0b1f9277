package config

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// testKinds is a stand-in source kind with one known key.
var testKinds = map[string]SourceDecoder{
	"fake": func(sec *Section) any { return sec.String("endpoint", "") },
}

const validConfig = `
state_dir = "/var/lib/kvmount-test"
log_level = "debug"
log_format = "json"
resync_interval = "1m"

[sources.main]
type = "fake"
endpoint = "e"

[[mount]]
name = "app"
dir = "/srv/app/config"
default_mode = "0640"
source = "main"
prefix = "/apps/app/"

  [[mount.items]]
  key = "db/password"
  path = "secrets/db-password"
  mode = "0400"

  [[mount.items]]
  key = "app.conf"
  path = "app.conf"
  optional = true

[[mount]]
name = "bundle"
dir = "/srv/bundle"
optional = true
  [[mount.projections]]
  source = "main"
  prefix = "/shared/"
  [[mount.projections]]
  source = "main"
  prefix = "/more/"
  optional = false
`

func TestParseValid(t *testing.T) {
	cfg, err := Parse("kvmount.toml", []byte(validConfig), testKinds)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.StateDir != "/var/lib/kvmount-test" || cfg.LogFormat != "json" || cfg.LogLevel.String() != "DEBUG" || cfg.ResyncInterval != time.Minute {
		t.Errorf("globals = %q %q %v %v", cfg.StateDir, cfg.LogFormat, cfg.LogLevel, cfg.ResyncInterval)
	}
	if got := cfg.Sources["main"]; got == nil || got.Type != "fake" || got.Settings != "e" {
		t.Errorf("source main = %+v", got)
	}
	if len(cfg.Mounts) != 2 {
		t.Fatalf("got %d mounts; want 2", len(cfg.Mounts))
	}
	app := cfg.Mounts[0]
	if app.Name != "app" || app.Dir != "/srv/app/config" || app.Medium != MediumDisk || app.DefaultMode != 0o640 || app.UID != -1 {
		t.Errorf("mount app = %+v", app)
	}
	wantItems := []Item{{Key: "db/password", Path: "secrets/db-password", Mode: 0o400}, {Key: "app.conf", Path: "app.conf", Optional: true}}
	if len(app.Projections) != 1 || app.Projections[0].Prefix != "/apps/app/" || len(app.Projections[0].Items) != 2 ||
		app.Projections[0].Items[0] != wantItems[0] || app.Projections[0].Items[1] != wantItems[1] {
		t.Errorf("mount app projections = %+v", app.Projections)
	}
	bundle := cfg.Mounts[1]
	if len(bundle.Projections) != 2 || !bundle.Projections[0].Optional || bundle.Projections[1].Optional || bundle.DefaultMode != DefaultMode {
		t.Errorf("mount bundle = %+v", bundle)
	}
}

func TestParseDefaults(t *testing.T) {
	cfg, err := Parse("k.toml", []byte("[sources.s]\ntype = \"fake\"\n[[mount]]\nname = \"m\"\ndir = \"/srv/m\"\nsource = \"s\"\n"), testKinds)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.StateDir != DefaultStateDir || cfg.LogFormat != "text" || cfg.LogLevel.String() != "INFO" || cfg.ResyncInterval != DefaultResyncInterval {
		t.Errorf("defaults = %+v", cfg)
	}
	if m := cfg.Mounts[0]; m.DefaultMode != 0o644 || m.Medium != "disk" || m.Projections[0].Items != nil {
		t.Errorf("mount defaults = %+v", m)
	}
}

// TestParseErrors checks that each problem is reported with its line, and
// that several problems are reported at once.
func TestParseErrors(t *testing.T) {
	head := "[sources.s]\ntype = \"fake\"\n" // lines 1-2
	tests := []struct {
		name string
		toml string
		want []string // each must appear, in this order
	}{
		{name: "syntax", toml: "a = \n", want: []string{"k.toml:1: "}},
		{name: "unknown top key", toml: "stat_dir = \"/x\"\n" + head, want: []string{`k.toml:1: stat_dir: unknown key (did you mean "state_dir"?)`}},
		{name: "prefix typo in second mount", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a"
source = "s"
prefix = "/a/"

[[mount]]
name = "b"
dir = "/srv/b"
source = "s"
prefx = "/b/"
`, want: []string{`k.toml:14: mount[1].prefx: unknown key (did you mean "prefix"?)`}},
		{name: "unknown key in item", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a"
source = "s"
  [[mount.items]]
  key = "k"
  path = "p"
  [[mount.items]]
  key = "k2"
  pth = "p2"
`, want: []string{`k.toml:11: mount[0].items[1]: path is missing`, `k.toml:13: mount[0].items[1].pth: unknown key (did you mean "path"?)`}},
		{name: "unknown key in source", toml: "[sources.s]\ntype = \"fake\"\nendpont = \"x\"\n", want: []string{`k.toml:3: sources.s.endpont: unknown key (did you mean "endpoint"?)`}},
		{name: "unknown source type", toml: "[sources.s]\ntype = \"zookeeper\"\n", want: []string{`k.toml:2: sources.s.type: unknown source type "zookeeper"; want one of "fake"`}},
		{name: "missing source type", toml: "[sources.s]\nendpoint = \"x\"\n", want: []string{`k.toml:1: sources.s: type is missing`}},
		{name: "wrong types", toml: head + `
[[mount]]
name = 5
dir = "/srv/a"
source = "s"
optional = "yes"
`, want: []string{`k.toml:5: mount[0].name: want a string, got an integer`, `k.toml:8: mount[0].optional: want true or false, got a string`}},
		{name: "bad duration, mode, size, level", toml: `resync_interval = "10 minutes"
log_level = "loud"
` + head + `
[[mount]]
name = "a"
dir = "/srv/a"
source = "s"
default_mode = "0999"
size_limit = "lots"
`, want: []string{
			`k.toml:1: resync_interval: bad duration "10 minutes"`,
			`k.toml:2: log_level: "loud" is not one of debug, info, warn, error`,
			`k.toml:10: mount[0].default_mode: bad mode "0999"`,
			`k.toml:11: mount[0].size_limit: bad size "lots"`,
			`k.toml:11: mount[0].size_limit: applies to medium "tmpfs" only`,
		}},
		{name: "lower bounds", toml: "resync_interval = \"500ms\"\n" + head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\ndefault_mode = \"0\"\n", want: []string{
			`k.toml:1: resync_interval: 500ms is shorter than the minimum of 1s`,
			`k.toml:8: mount[0].default_mode: mode 0 gives nobody access`,
		}},
		{name: "mode beyond 0777", toml: head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\ndefault_mode = \"4755\"\n", want: []string{`k.toml:7: mount[0].default_mode: mode 04755 has bits beyond 0777`}},
		{name: "duplicate names and dirs", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a"
source = "s"
[[mount]]
name = "a"
dir = "/srv/a/"
source = "s"
`, want: []string{`k.toml:9: mount[1].name: mount name "a" is already used by mount[0]`, `k.toml:10: mount[1].dir: "/srv/a" is already the dir of mount[0] (a)`}},
		{name: "nested dirs", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a"
source = "s"
[[mount]]
name = "b"
dir = "/srv/a/b"
source = "s"
`, want: []string{`k.toml:10: mount[1].dir: "/srv/a/b" and the dir of mount[0] (a), "/srv/a", are nested`}},
		{name: "nested dirs, the parent later", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a/b/c"
source = "s"
[[mount]]
name = "b"
dir = "/srv/a"
source = "s"
`, want: []string{`k.toml:10: mount[1].dir: "/srv/a" and the dir of mount[0] (a), "/srv/a/b/c", are nested`}},
		{name: "unknown source", toml: head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"nope\"\n", want: []string{`k.toml:6: mount[0].source: unknown source "nope"`}},
		{name: "relative dir", toml: head + "[[mount]]\nname = \"a\"\ndir = \"srv/a\"\nsource = \"s\"\n", want: []string{`k.toml:5: mount[0].dir: "srv/a" is not an absolute path`}},
		{name: "system roots", toml: head + `
[[mount]]
name = "a"
dir = "/"
source = "s"
[[mount]]
name = "b"
dir = "/etc"
source = "s"
[[mount]]
name = "c"
dir = "/usr/"
source = "s"
[[mount]]
name = "d"
dir = "/var"
source = "s"
[[mount]]
name = "e"
dir = "/boot"
source = "s"
`, want: []string{`k.toml:6: mount[0].dir: "/" is a system directory`, `k.toml:10: mount[1].dir: "/etc" is a system directory`,
			`k.toml:14: mount[2].dir: "/usr" is a system directory`, `k.toml:18: mount[3].dir: "/var" is a system directory`, `k.toml:22: mount[4].dir: "/boot" is a system directory`}},
		{name: "source and projections", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a"
source = "s"
  [[mount.projections]]
  source = "s"
`, want: []string{`k.toml:8: mount[0].projections: a mount uses either source/prefix/items or [[mount.projections]], not both`}},
		{name: "no source at all", toml: head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\n", want: []string{`k.toml:3: mount[0]: source is missing`}},
		{name: "guard rails", toml: head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\nmin_keys = -1\ncheck_command = []\ncheck_timeout = \"1s\"\nmax_value_size = 0\n",
			want: []string{`k.toml:7: mount[0].min_keys: -1 is outside`, `k.toml:8: mount[0].check_command: needs a program`, `k.toml:10: mount[0].max_value_size: size 0 must be positive`}},
		{name: "check_timeout alone", toml: head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\ncheck_timeout = \"1s\"\n", want: []string{`k.toml:7: mount[0].check_timeout: applies with check_command only`}},
		{name: "bad medium", toml: head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\nmedium = \"ramdisk\"\n", want: []string{`k.toml:7: mount[0].medium: "ramdisk" is not one of disk, tmpfs`}},
		{name: "bad name", toml: head + "[[mount]]\nname = \"App Config\"\ndir = \"/srv/a\"\nsource = \"s\"\n", want: []string{`k.toml:4: mount[0].name: "App Config" must match`}},
		{name: "bad item path", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a"
source = "s"
  [[mount.items]]
  key = "k"
  path = "../escape"
`, want: []string{`k.toml:10: mount[0].items[0].path: invalid path "../escape": must not start with '..'`}},
		{name: "two items same path", toml: head + `
[[mount]]
name = "a"
dir = "/srv/a"
  [[mount.projections]]
  source = "s"
    [[mount.projections.items]]
    key = "k"
    path = "same"
  [[mount.projections]]
  source = "s"
    [[mount.projections.items]]
    key = "j"
    path = "./same"
`, want: []string{`k.toml:16: mount[0].projections[1].items[0].path: "./same" produces the path "same" of another item`}},
		{name: "unknown user", toml: head + "[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\nuser = \"no-such-user-kvmount\"\n", want: []string{`k.toml:7: mount[0].user: user: unknown user no-such-user-kvmount`}},
		{name: "mount overlaps state dir", toml: "state_dir = \"/srv/state\"\n" + head + "[[mount]]\nname = \"a\"\ndir = \"/srv/state/a\"\nsource = \"s\"\n", want: []string{`k.toml:6: mount[0].dir: "/srv/state/a" overlaps state_dir`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("k.toml", []byte(tt.toml), testKinds)
			var list ErrorList
			if !errors.As(err, &list) {
				t.Fatalf("Parse error = %v; want an ErrorList", err)
			}
			msg := err.Error()
			rest := msg
			for _, want := range tt.want {
				i := strings.Index(rest, want)
				if i < 0 {
					t.Fatalf("errors:\n%s\nwant (in order) %q", msg, want)
				}
				rest = rest[i+len(want):]
			}
		})
	}
}

// TestMultiLineInlineTable: keys inside and after an inline table that
// spans lines (TOML 1.1) carry their own lines.
func TestMultiLineInlineTable(t *testing.T) {
	src := "[sources.s]\ntype = \"fake\"\n[[mount]]\nname = \"b\"\ndir = \"/srv/b\"\nsource = \"s\"\nprefix = \"b/\"\ntls = {\n  # a comment\n  ca = \"x\",\n  bogus = 1,\n}\nprefx = 1\n"
	_, err := Parse("k.toml", []byte(src), testKinds)
	for _, want := range []string{"k.toml:8: mount[0].tls: unknown key", "k.toml:13: mount[0].prefx: unknown key"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("errors %v; want %q", err, want)
		}
	}
}

// TestSearchLine: the fallback that finds a key's line by its text when
// the locator stopped early.
func TestSearchLine(t *testing.T) {
	src := "[[mount]]\nname = \"a\"\n[[mount]]\n  name=\"b\"\n  \"quoted\" = 1\n  dotted.key = 2\n"
	for _, tt := range []struct {
		from int
		key  string
		want int
	}{{1, "name", 2}, {3, "name", 4}, {1, "quoted", 5}, {1, "dotted", 6}, {1, "missing", 0}} {
		if got := searchLine(src, tt.from, tt.key); got != tt.want {
			t.Errorf("searchLine(from %d, %q) = %d; want %d", tt.from, tt.key, got, tt.want)
		}
	}
}

// TestWarnings: a prefix without a trailing "/" is valid, with a warning
// at its line.
func TestWarnings(t *testing.T) {
	toml := "[sources.s]\ntype = \"fake\"\n[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\nprefix = \"app\"\n[[mount]]\nname = \"b\"\ndir = \"/srv/b\"\nsource = \"s\"\nprefix = \"b/\"\n"
	cfg, err := Parse("k.toml", []byte(toml), testKinds)
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Warnings) != 1 || !strings.HasPrefix(cfg.Warnings[0].Error(), `k.toml:7: mount[0].prefix: "app" does not end in "/"`) {
		t.Errorf("warnings %v; want one for mount[0].prefix at line 7", cfg.Warnings)
	}
}

func TestLoadReadsFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kvmount.toml")
	if err := os.WriteFile(path, []byte(validConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path, testKinds); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path+".missing", testKinds); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Load(missing) = %v; want ErrNotExist", err)
	}
}

func TestLocateKeys(t *testing.T) {
	src := `# comment [[mount]]
a = """
[[mount]]
b = 1
"""
s = 'it"s' # not a key = here
arr = [
  1, # x = 2
  { k = "v", n = { m = 1 } },
]
"quoted.key" = true
dotted.key = 3
[[mount]] # first
name = "x"
  [[mount.items]]
  key = "k"
  [mount.tls]
  ca_file = "c"
[[mount]]
name = '''y
'''
  [[mount.items]]
  key = "k0"
  [[mount.items]]
  key = "k1"
[sources."my.src"]
type = "etcd"
lit = '''a''''
after = 1
`
	lines, complete := locateKeys(src)
	if !complete {
		t.Errorf("the locator stopped early")
	}
	tests := []struct {
		path []string
		want int
	}{
		{[]string{"a"}, 2},
		{[]string{"s"}, 6},
		{[]string{"arr"}, 7},
		{[]string{"arr", "1", "k"}, 9},
		{[]string{"arr", "1", "n", "m"}, 9},
		{[]string{"quoted.key"}, 11},
		{[]string{"dotted"}, 12},
		{[]string{"dotted", "key"}, 12},
		{[]string{"mount", "0"}, 13},
		{[]string{"mount", "0", "name"}, 14},
		{[]string{"mount", "0", "items", "0", "key"}, 16},
		{[]string{"mount", "0", "tls", "ca_file"}, 18},
		{[]string{"mount", "1", "name"}, 20},
		{[]string{"mount", "1", "items", "0", "key"}, 23},
		{[]string{"mount", "1", "items", "1", "key"}, 25},
		{[]string{"sources", "my.src", "type"}, 27},
		{[]string{"sources", "my.src", "after"}, 29},
	}
	for _, tt := range tests {
		if got := lines[pathKey(tt.path)]; got != tt.want {
			t.Errorf("line of %q = %d; want %d", tt.path, got, tt.want)
		}
	}
	if _, ok := lines[pathKey([]string{"b"})]; ok {
		t.Errorf("a key inside a multi-line string was recorded")
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1": 1, "512B": 512, "16KiB": 16 << 10, "16MiB": 16 << 20, "2GiB": 2 << 30, " 4 MiB ": 4 << 20} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1MiB", "1MB", "lots", "99999999999GiB"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) succeeded; want an error", in)
		}
	}
}

// FuzzParse feeds arbitrary files to Parse: it must never panic, and must
// return either a config or an ErrorList whose errors name the file.
func FuzzParse(f *testing.F) {
	f.Add(validConfig)
	f.Add("[sources.s]\ntype = \"fake\"\n[[mount]]\nname = \"a\"\n")
	f.Add("a = [\n{ b = 1 },\n]\n[[x]]\n[[x.y]]\nz = '''\n'''\n")
	f.Add("[[mount]]\nname = \"b\"\nw = {\n  a = 1,\n}\nprefx = 1\n")
	f.Fuzz(func(t *testing.T, src string) {
		cfg, err := Parse("f.toml", []byte(src), testKinds)
		if err == nil {
			if cfg == nil {
				t.Fatal("nil config without error")
			}
			return
		}
		var list ErrorList
		if !errors.As(err, &list) || len(list) == 0 {
			t.Fatalf("error %v is not a non-empty ErrorList", err)
		}
		for _, e := range list {
			if e.File != "f.toml" {
				t.Fatalf("error %v does not name the file", e)
			}
			if strings.HasPrefix(e.Msg, "unknown key") && e.Line == 0 {
				t.Fatalf("unknown key error without a line: %v\nin:\n%s", e, src)
			}
		}
	})
}

// TestNotifyWaitAdmin decodes [[mount.notify]] entries of every kind,
// wait and [admin], and reports their problems at their lines.
func TestNotifyWaitAdmin(t *testing.T) {
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("s3cr3t\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	head := "[sources.s]\ntype = \"fake\"\n[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\nprefix = \"a/\"\n" // lines 1-7
	valid := "[admin]\naddress = \"unix:/run/kvmount/admin.sock\"\n" + head + `wait = { min = "2s", max = "10s" }
  [[mount.notify]]
  command = ["/usr/sbin/nginx", "-s", "reload"]
  timeout = "5s"
  [[mount.notify]]
  signal = "HUP"
  pid_file = "/run/nginx.pid"
  [[mount.notify]]
  systemd_unit = "nginx.service"
  action = "try-reload-or-restart"
  [[mount.notify]]
  webhook = "https://user:pw@127.0.0.1:8080/hook?x=1"
  headers = { X-Env = "prod" }
  header_files = { Authorization = "` + token + `" }
`
	cfg, err := Parse("k.toml", []byte(valid), testKinds)
	if err != nil {
		t.Fatal(err)
	}
	m := cfg.Mounts[0]
	if cfg.Admin != "unix:/run/kvmount/admin.sock" || m.Wait != (Wait{Min: 2 * time.Second, Max: 10 * time.Second}) || len(m.Notify) != 4 {
		t.Fatalf("admin %q, wait %+v, %d notify entries", cfg.Admin, m.Wait, len(m.Notify))
	}
	got := fmt.Sprintf("%s %v %v | %s %v %s | %s %s | %s %s %v %s", m.Notify[0].Kind, m.Notify[0].Command, m.Notify[0].Timeout,
		m.Notify[1].Kind, m.Notify[1].Signal, m.Notify[1].PIDFile, m.Notify[2].Unit, m.Notify[2].Action,
		m.Notify[3].Kind, m.Notify[3].Target(), m.Notify[3].Headers, m.Notify[3].HeaderFiles["Authorization"].Reveal())
	want := "command [/usr/sbin/nginx -s reload] 5s | signal hangup /run/nginx.pid | nginx.service try-reload-or-restart | webhook https://127.0.0.1:8080/hook map[X-Env:prod] s3cr3t"
	if got != want {
		t.Errorf("decoded %s\nwant    %s", got, want)
	}
	if def, err := Parse("k.toml", []byte(head), testKinds); err != nil || def.Admin != DefaultAdminAddress {
		t.Errorf("default admin address %q, %v", def.Admin, err)
	}
	bad := "[admin]\naddress = \"0.0.0.0:9797\"\n" + head + `wait = { max = "1s" }
  [[mount.notify]]
  command = ["x"]
  signal = "HUP"
  [[mount.notify]]
  signal = "SIGNOPE"
  [[mount.notify]]
  webhook = "ftp://x"
  action = "reload"
`
	_, err = Parse("k.toml", []byte(bad), testKinds)
	for _, w := range []string{
		`k.toml:2: admin.address: "0.0.0.0:9797" is not a loopback address`,
		`k.toml:10: mount[0].wait: needs min`,
		`k.toml:13: mount[0].notify[0].signal: an entry has one kind; command and signal are both set`,
		`k.toml:15: mount[0].notify[1].signal: unknown signal "SIGNOPE"`,
		`mount[0].notify[1]: a signal entry needs pid_file`,
		`k.toml:17: mount[0].notify[2].webhook: "ftp://x": want an http:// or https:// URL`,
		`k.toml:18: mount[0].notify[2].action: applies to systemd_unit entries only`,
	} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("errors:\n%v\nwant %q", err, w)
		}
	}
}

// TestTemplates decodes [[mount.templates]]: a file and inline text,
// syntax errors at the template file's line or at the config file's line
// of the inline text's line, env refused, collisions named, keys_as_files.
func TestTemplates(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.tmpl")
	bad := filepath.Join(dir, "bad.tmpl")
	if err := os.WriteFile(good, []byte(`listen {{ key "port" }};`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, []byte("line 1\nline 2 {{ env \"HOME\" }}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	head := "[sources.s]\ntype = \"fake\"\n[[mount]]\nname = \"a\"\ndir = \"/srv/a\"\nsource = \"s\"\nprefix = \"a/\"\n" // lines 1-7
	valid := head + fmt.Sprintf("keys_as_files = false\n  [[mount.templates]]\n  path = \"nginx.conf\"\n  file = %q\n  mode = \"0600\"\n  [[mount.templates]]\n  path = \"x/inline\"\n  text = '{{ keyOrDefault \"x\" \"y\" }}'\n", good)
	cfg, err := Parse("k.toml", []byte(valid), testKinds)
	if err != nil {
		t.Fatal(err)
	}
	m := cfg.Mounts[0]
	if m.KeysAsFiles || len(m.Templates) != 2 || m.Templates[0].Path != "nginx.conf" || m.Templates[0].Mode != 0o600 || m.Templates[1].Origin != "k.toml:15" {
		t.Fatalf("decoded keys_as_files %v, templates %+v", m.KeysAsFiles, m.Templates)
	}
	if def, _ := Parse("k.toml", []byte(head), testKinds); !def.Mounts[0].KeysAsFiles {
		t.Errorf("keys_as_files defaults to false")
	}
	invalid := head + fmt.Sprintf(`  [[mount.items]]
  key = "k"
  path = "same"
  [[mount.templates]]
  path = "same"
  text = "x"
  [[mount.templates]]
  path = "bad"
  file = %q
  [[mount.templates]]
  path = "inline"
  text = """
ok
{{ if }}"""
  [[mount.templates]]
  path = "two"
  text = "x"
  [[mount.templates]]
  path = "two"
  text = "y"
`, bad)
	_, err = Parse("k.toml", []byte(invalid), testKinds)
	for _, w := range []string{
		`k.toml:12: mount[0].templates[0].path: "same" is also the path of an item`,
		`k.toml:16: mount[0].templates[1].file: template: ` + bad + `:2:10: function "env" is refused: it reads the environment`,
		`k.toml:21: mount[0].templates[2].text: template: missing value for if`,
		`k.toml:26: mount[0].templates[4].path: "two" is also the path of templates[3]`,
	} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("errors:\n%v\nwant %q", err, w)
		}
	}
	// A template with an error: only that error, not that the mount has
	// no templates (it has, one that does not parse).
	_, err = Parse("k.toml", []byte(head+"keys_as_files = false\n  [[mount.templates]]\n  path = \"x\"\n  text = '{{ nosuch }}'\n"), testKinds)
	if err == nil || !strings.Contains(err.Error(), `function "nosuch" not defined`) || strings.Contains(err.Error(), "has no [[mount.templates]]") {
		t.Errorf("keys_as_files with a broken template: %v; want only the template's error", err)
	}
	_, err = Parse("k.toml", []byte(head+"keys_as_files = false\n"), testKinds)
	if err == nil || !strings.Contains(err.Error(), "k.toml:8: mount[0].keys_as_files: false makes the keys feed templates only") {
		t.Errorf("keys_as_files without templates: %v", err)
	}
}

// TestCommandUsers: a mount's check and notify commands run as the mount's
// user (and group), else nobody; root only when check_user or notify_user
// says so, with a warning; a check user who cannot read the mount's files
// is warned about.
func TestCommandUsers(t *testing.T) {
	head := "[sources.s]\ntype = \"fake\"\n[[mount]]\nname = \"m\"\ndir = \"/srv/m\"\nsource = \"s\"\nprefix = \"m/\"\ncheck_command = [\"true\"]\n"
	notify := "  [[mount.notify]]\n  command = [\"true\"]\n"
	for _, tt := range []struct {
		name, extra                              string
		checkUID, checkGID, notifyUID, notifyGID int
		warn                                     string
	}{
		{name: "no user: nobody", checkUID: Nobody, checkGID: Nobody, notifyUID: Nobody, notifyGID: Nobody},
		{name: "the mount's user and group", extra: "user = \"4321\"\ngroup = \"8765\"\n", checkUID: 4321, checkGID: 8765, notifyUID: 4321, notifyGID: 8765},
		{name: "the mount's user, its primary group", extra: "user = \"4321\"\n", checkUID: 4321, checkGID: 4321, notifyUID: 4321, notifyGID: 4321},
		{name: "a mount of root's: nobody", extra: "user = \"0\"\n", checkUID: Nobody, checkGID: Nobody, notifyUID: Nobody, notifyGID: Nobody},
		{name: "root by name, warned", extra: "check_user = \"root\"\n", checkUID: 0, checkGID: 0, notifyUID: Nobody, notifyGID: Nobody,
			warn: "mount[0].check_user: commands of this mount run as root and interpret what the store's writers chose"},
		{name: "notify_user root, warned", extra: "notify_user = \"0\"\n", checkUID: Nobody, checkGID: Nobody, notifyUID: 0, notifyGID: 0,
			warn: "mount[0].notify_user: commands of this mount run as root"},
		{name: "a check user who cannot read the files", extra: "default_mode = \"0400\"\n", checkUID: Nobody, checkGID: Nobody, notifyUID: Nobody, notifyGID: Nobody,
			warn: "mount[0].check_command: check_command runs as uid 65534, who cannot read the mount's files"},
		{name: "a check user who cannot enter the directories", extra: "user = \"4321\"\ndir_mode = \"0700\"\ncheck_user = \"5555\"\n", checkUID: 5555, checkGID: 5555, notifyUID: 4321, notifyGID: 4321,
			warn: "who cannot enter the new version's directories"},
		{name: "the directories' owner checks", extra: "user = \"4321\"\ndir_mode = \"0700\"\ndefault_mode = \"0400\"\n", checkUID: 4321, checkGID: 4321, notifyUID: 4321, notifyGID: 4321},
		{name: "the mount's group may enter", extra: "user = \"4321\"\ngroup = \"8765\"\ndir_mode = \"0750\"\n", checkUID: 4321, checkGID: 8765, notifyUID: 4321, notifyGID: 8765},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := Parse("k.toml", []byte(head+tt.extra+notify), testKinds)
			if err != nil {
				t.Fatal(err)
			}
			m := cfg.Mounts[0]
			if m.CheckUID != tt.checkUID || m.CheckGID != tt.checkGID || m.Notify[0].UID != tt.notifyUID || m.Notify[0].GID != tt.notifyGID {
				t.Errorf("check %d:%d, notify %d:%d; want %d:%d, %d:%d", m.CheckUID, m.CheckGID, m.Notify[0].UID, m.Notify[0].GID, tt.checkUID, tt.checkGID, tt.notifyUID, tt.notifyGID)
			}
			found := tt.warn == ""
			for _, w := range cfg.Warnings {
				found = found || strings.Contains(w.Error(), tt.warn)
			}
			if !found || tt.warn == "" && len(cfg.Warnings) > 0 {
				t.Errorf("warnings %v; want %q", cfg.Warnings, tt.warn)
			}
		})
	}
	if _, err := Parse("k.toml", []byte(head[:strings.Index(head, "check_command")]+"notify_user = \"4321\"\n"), testKinds); err == nil || !strings.Contains(err.Error(), "notify_user: applies with a [[mount.notify]] command entry only") {
		t.Errorf("notify_user without a command entry: %v", err)
	}
}

// TestTLSFilesReadAsCredentials is the second review's twelfth finding:
// TLS files were read following symlinks, blocking and unbounded — a FIFO
// as ca_file hung kvmount check, start and reload for good, /dev/zero ran
// kvmount out of memory — and a key_file a user owns and everyone reads
// drew no warning. They are read as credential files now: a FIFO, a
// device, a symlink are refused at once, at their line; the key warns as a
// credential does; a valid pair loads.
func TestTLSFilesReadAsCredentials(t *testing.T) {
	kinds := map[string]SourceDecoder{"fake": func(sec *Section) any { return sec.TLS("tls") }}
	dir := t.TempDir()
	fifo := filepath.Join(dir, "ca.fifo")
	if err := unix.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "ca.link")
	if err := os.Symlink("/etc/ssl/certs/ca-certificates.crt", link); err != nil {
		t.Fatal(err)
	}
	parse := func(tls string) (*Config, error) {
		type result struct {
			cfg *Config
			err error
		}
		done := make(chan result, 1)
		go func() {
			cfg, err := Parse("k.toml", []byte("[sources.s]\ntype = \"fake\"\ntls = "+tls+"\n"), kinds)
			done <- result{cfg, err}
		}()
		select {
		case r := <-done:
			return r.cfg, r.err
		case <-time.After(10 * time.Second):
			t.Fatalf("parsing tls = %s hangs", tls)
			return nil, nil
		}
	}
	for _, tt := range []struct{ name, file, want string }{
		{"a FIFO", fifo, "not a regular file"},
		{"a device", "/dev/zero", "not a regular file"},
		{"a symlink", link, "a symlink"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parse(fmt.Sprintf("{ ca_file = %q }", tt.file))
			if err == nil || !strings.Contains(err.Error(), "k.toml:3") || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("ca_file = %s: %v; want an error at line 3 saying %q", tt.file, err, tt.want)
			}
		})
	}
	cert, key := selfSigned(t, dir)
	if err := os.Chmod(key, 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := parse(fmt.Sprintf("{ ca_file = %q, cert_file = %q, key_file = %q }", cert, cert, key))
	if err != nil {
		t.Fatal(err)
	}
	if len(cfg.Warnings) != 1 || !strings.Contains(cfg.Warnings[0].Error(), "holds a credential and is readable by every user") {
		t.Errorf("warnings %v; want one for the world-readable key_file", cfg.Warnings)
	}
	tlsCfg := cfg.Sources["s"].Settings.(TLS)
	if c, err := tlsCfg.Config(); err != nil || len(c.Certificates) != 1 || c.RootCAs == nil {
		t.Errorf("Config = %+v, %v; want the pair and the roots", c, err)
	}
}

// selfSigned writes a self-signed certificate and its key into dir and
// returns their paths.
func selfSigned(t *testing.T, dir string) (cert, key string) {
	t.Helper()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kvmount test"}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &priv.PublicKey, priv)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	cert, key = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return cert, key
}

// plainSettings are the settings of a source kind that reaches its store
// over plain TCP.
type plainSettings struct{}

func (plainSettings) PlainTCP() []string { return []string{"http://127.0.0.1:2379"} }

// TestPlainTCPWarnedOncePerSource: mounts of root's fed over plain TCP are
// one warning per source, at the first mount's source, naming the first
// three and counting the rest — not one per mount, a thousand at each
// start of a daemon of a thousand mounts; a mount of a user's is none of
// them.
func TestPlainTCPWarnedOncePerSource(t *testing.T) {
	kinds := map[string]SourceDecoder{"plain": func(*Section) any { return plainSettings{} }}
	var toml strings.Builder
	toml.WriteString("[sources.tcp]\ntype = \"plain\"\n[sources.other]\ntype = \"plain\"\n")
	for _, m := range []string{"a", "b", "c", "d", "e"} {
		fmt.Fprintf(&toml, "[[mount]]\nname = %q\ndir = \"/srv/%s\"\nsource = \"tcp\"\nprefix = \"%s/\"\n", m, m, m)
	}
	toml.WriteString("[[mount]]\nname = \"users\"\ndir = \"/srv/users\"\nuser = \"65534\"\nsource = \"other\"\nprefix = \"u/\"\n")
	toml.WriteString("[[mount]]\nname = \"f\"\ndir = \"/srv/f\"\nsource = \"other\"\nprefix = \"f/\"\n")
	cfg, err := Parse("k.toml", []byte(toml.String()), kinds)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, w := range cfg.Warnings {
		got = append(got, w.Error())
	}
	want := []string{
		"k.toml:8: mount[0].source: mounts a, b, c and 2 more are root's, and source tcp feeds them over plain TCP (http://127.0.0.1:2379): a local user who takes that port while the store is down, or before it is up at boot, chooses their content;",
		"k.toml:39: mount[6].source: mount f is root's, and source other feeds it over plain TCP (http://127.0.0.1:2379): a local user who takes that port while the store is down, or before it is up at boot, chooses its content;",
	}
	if len(got) != len(want) {
		t.Fatalf("warnings %q; want %d", got, len(want))
	}
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]) {
			t.Errorf("warning %d: %q; want it to start %q", i, got[i], want[i])
		}
	}
}
