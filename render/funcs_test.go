package render

import (
	"crypto/hmac"
	"crypto/md5"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"
)

// keyView returns a key view of path, value pairs, each path also its
// full key; a path ending in "/" is a folder marker.
func keyView(kv ...string) *Keys {
	k := NewKeys()
	for i := 0; i+1 < len(kv); i += 2 {
		if strings.HasSuffix(kv[i], "/") {
			k.AddFolder(kv[i], kv[i], []byte(kv[i+1]))
			continue
		}
		k.Add(kv[i], kv[i], []byte(kv[i+1]))
	}
	return k
}

// run renders text over keys.
func run(t *testing.T, text string, keys *Keys) (string, error) {
	t.Helper()
	tmpl, err := Parse("t", text)
	if err != nil {
		return "", err
	}
	out, _, err := tmpl.Execute(keys, Limits{MaxOutput: 1 << 20, Timeout: 5 * time.Second})
	return string(out), err
}

// docCase is an example of consul-template's docs/templating-language.md,
// with what it renders there.
type docCase struct {
	name, text, want string
	keys             *Keys
}

// docCases are the examples of consul-template's templating language
// documentation, "Helper Functions", "Math Functions" and "Scratch" (and
// the key functions'), with the outputs it gives; where the docs give
// none, the output consul-template's implementation produces.
var docCases = []docCase{
	{"base64Decode", `{{ base64Decode "aGVsbG8=" }}`, "hello", nil},
	{"base64Encode", `{{ base64Encode "hello" }}`, "aGVsbG8=", nil},
	{"base64URLDecode", `{{ base64URLDecode "aGVsbG8=" }}`, "hello", nil},
	{"base64URLEncode", `{{ base64URLEncode "hello?>" }}`, "aGVsbG8_Pg==", nil},
	{"byKey", `{{ range $key, $pairs := tree "groups" | byKey }}{{ $key }}:
{{ range $pair := $pairs }}  {{ .Key }}={{ .Value }}
{{ end }}{{ end }}`, "elasticsearch:\n  es1=1\n  es2=1\n  es3=1\n",
		keyView("groups/elasticsearch/es1", "1", "groups/elasticsearch/es2", "1", "groups/elasticsearch/es3", "1", "services/elasticsearch/check", "x")},
	{"contains", `{{ if split "," "web,production" | contains "production" }}yes{{ end }}{{ if "a-production" | contains "prod" }}!{{ end }}`, "yes!", nil},
	{"containsAll", `{{ containsAll (sprig_list "a" "b") (split "," "a,b,c") }} {{ containsAll (sprig_list "a" "z") (split "," "a,b,c") }} {{ containsAll (sprig_list) (split "," "a") }}`, "true false true", nil},
	{"containsAny", `{{ containsAny (sprig_list "z" "b") (split "," "a,b,c") }} {{ containsAny (sprig_list "z") (split "," "a,b,c") }} {{ containsAny (sprig_list) (split "," "a") }}`, "true false false", nil},
	{"containsNone", `{{ containsNone (sprig_list "z" "y") (split "," "a,b,c") }} {{ containsNone (sprig_list "z" "a") (split "," "a,b,c") }} {{ containsNone (sprig_list) (split "," "a") }}`, "true false true", nil},
	{"containsNotAll", `{{ containsNotAll (sprig_list "a" "z") (split "," "a,b,c") }} {{ containsNotAll (sprig_list "a" "b") (split "," "a,b,c") }} {{ containsNotAll (sprig_list) (split "," "a") }}`, "true false false", nil},
	{"explode", `{{ with tree "config" | explode }}{{ .a.b.c }}{{ end }}`, "deep", keyView("config/a/b/c", "deep", "config/x", "1")},
	{"explodeMap", `{{ scratch.MapSet "example" "foo/bar" "a" }}{{ scratch.MapSet "example" "foo/baz" "b" }}{{ scratch.Get "example" | explodeMap | toYAML }}`, "foo:\n  bar: a\n  baz: b", nil},
	{"indent", `{{ "a:\n  b: 1\n\nc: 2\n" | indent 4 }}`, "    a:\n      b: 1\n\n    c: 2\n", nil},
	{"in", `{{ if in (split "," "web,production") "production" }}yes{{ end }}`, "yes", nil},
	{"loop", `{{ range loop 3 }}#{{ end }}{{ range $i := loop 5 8 }}
stanza-{{ $i }}{{ end }}`, "###\nstanza-5\nstanza-6\nstanza-7", nil},
	{"join", `{{ split "," "a,b,c" | join ";" }}`, "a;b;c", nil},
	{"mergeMap", `{{ $base := tree "base" | explode }}{{ $o := tree "overrides" | explode | mergeMap $base }}{{ $o.a.b }} {{ $o.a.c }} {{ $o.d }}`, "base over base-only",
		keyView("base/a/b", "base", "base/d", "base-only", "overrides/a/b", "over", "overrides/a/c", "over")},
	{"mergeMapWithOverride", `{{ $base := tree "base" | explode }}{{ $o := tree "overrides" | explode | mergeMapWithOverride $base }}{{ $o.a.b }} {{ $o.d }}`, "over base-only",
		keyView("base/a/b", "base", "base/d", "base-only", "overrides/a/b", "over")},
	{"trimSpace", `{{ "  v1.2 \n\t" | trimSpace }}`, "v1.2", nil},
	{"trim", `{{ "hello world!!" | trim "!!" }}`, "hello world", nil},
	{"trimPrefix", `{{ "hello world!!" | trimPrefix "hello" }}`, " world!!", nil},
	{"trimSuffix", `{{ "hello world!!" | trimSuffix "world!!" }}`, "hello ", nil},
	{"parseBool", `{{ "true" | parseBool }} {{ "" | parseBool }}`, "true false", nil},
	{"parseFloat", `{{ "1.2" | parseFloat }} {{ "" | parseFloat }}`, "1.2 0", nil},
	{"parseInt", `{{ "1" | parseInt }} {{ range $i := loop (key "pool" | parseInt) }}{{ $i }}{{ end }}`, "1 012", keyView("pool", "3")},
	{"parseUint", `{{ "1" | parseUint }}`, "1", nil},
	{"parseJSON", `{{ with $d := key "user/info" | parseJSON }}{{ $d.name }}{{ end }}`, "ada", keyView("user/info", `{"name":"ada"}`)},
	{"parseYAML", `{{ with $d := key "user/info" | parseYAML }}{{ $d.name }}{{ end }}`, "ada", keyView("user/info", "name: ada\n")},
	{"regexMatch", `{{ if "foo.bar" | regexMatch "foo([.a-z]+)" }}yes{{ else }}no{{ end }}`, "yes", nil},
	{"regexReplaceAll", `{{ "foo.bar" | regexReplaceAll "foo([.a-z]+)" "$1" }}`, ".bar", nil},
	{"replaceAll", `{{ "foo.bar" | replaceAll "." "_" }}`, "foo_bar", nil},
	{"sha256Hex", `{{ "bladibla" | sha256Hex }}`, "54cf4c66bcabb5c20e25331c01dd600b73369e97a947861bd8d3a0e0b8b3d70b", nil},
	{"md5sum", `{{ "myString" | md5sum }}`, "", nil},
	{"hmacSHA256Hex", `{{ hmacSHA256Hex "somemessage" "somekey" }} {{ "somekey" | hmacSHA256Hex "somemessage" }}`, "", nil},
	{"split", `{{ range "foo\nbar\n" | split "\n" }}[{{ . }}]{{ end }}{{ range split "," "2,10,1" }}{{ . }} {{ end }}`, "[foo][bar]2 10 1 ", nil},
	{"splitToMap", `{{ $m := "foo:bar\nbaz:bat\n" | splitToMap "\n" ":" }}{{ $m.foo }} {{ $m.baz }}`, "bar bat", nil},
	{"toJSON", `{{ tree "config" | explode | toJSON }}`, `{"admin":{"port":"1234"},"maxconns":"5","minconns":"2"}`, keyView("config/admin/port", "1234", "config/maxconns", "5", "config/minconns", "2")},
	{"toJSONPretty", `{{ tree "config" | explode | toJSONPretty }}`, "{\n  \"admin\": {\n    \"port\": \"1234\"\n  },\n  \"maxconns\": \"5\",\n  \"minconns\": \"2\"\n}", keyView("config/admin/port", "1234", "config/maxconns", "5", "config/minconns", "2")},
	{"toUnescapedJSON", `{{ tree "config" | explode | toUnescapedJSON }}`, `{"maxconns":"5","queryparams":"a?b=c&d=e"}`, keyView("config/maxconns", "5", "config/queryparams", "a?b=c&d=e")},
	{"toUnescapedJSONPretty", `{{ tree "config" | explode | toUnescapedJSONPretty }}`, "{\n  \"queryparams\": \"a?b=c&d=e\"\n}", keyView("config/queryparams", "a?b=c&d=e")},
	{"toLower", `{{ key "user/name" | toLower }}`, "ada lovelace", keyView("user/name", "Ada LoveLace")},
	{"toTitle", `{{ key "user/name" | toTitle }}`, "Ada LoveLace", keyView("user/name", "ada loveLace")},
	{"toUpper", `{{ key "user/name" | toUpper }}`, "ADA", keyView("user/name", "ada")},
	{"toTOML", `{{ tree "config" | explode | toTOML }}`, "maxconns = \"5\"\nminconns = \"2\"\n\n[admin]\n  port = \"1134\"", keyView("config/admin/port", "1134", "config/maxconns", "5", "config/minconns", "2")},
	{"toYAML", `{{ tree "config" | explode | toYAML }}`, "admin:\n  port: \"1234\"\nmaxconns: \"5\"\nminconns: \"2\"", keyView("config/admin/port", "1234", "config/maxconns", "5", "config/minconns", "2")},
	{"add", `{{ add 1 2 }} {{ 1 | add 2 }} {{ add 1.5 2 }}`, "3 3 3.5", nil},
	{"subtract", `{{ subtract 2 5 }} {{ 5 | subtract 2 }}`, "3 3", nil},
	{"multiply", `{{ multiply 2 2 }} {{ 2 | multiply 2 }}`, "4 4", nil},
	{"divide", `{{ divide 2 10 }} {{ 10 | divide 2 }} {{ 10.0 | divide 4 }}`, "5 5 2.5", nil},
	{"modulo", `{{ modulo 2 5 }} {{ 5 | modulo 2 }}`, "1 1", nil},
	{"minimum", `{{ minimum 2 5 }} {{ 5 | minimum 2 }}`, "2 2", nil},
	{"maximum", `{{ maximum 2 5 }} {{ 5 | maximum 2 }}`, "5 5", nil},
	{"scratch", `{{ scratch.Key "foo" }} {{ scratch.Set "foo" "bar" }}{{ scratch.Key "foo" }} {{ scratch.Get "foo" }} {{ scratch.SetX "foo" "no" }}{{ scratch.Get "foo" }} ` +
		`{{ scratch.MapSet "vars" "b" "2" }}{{ scratch.MapSet "vars" "a" "1" }}{{ scratch.MapSetX "vars" "a" "x" }}{{ range scratch.MapValues "vars" }}{{ . }}{{ end }}`, "false true bar bar 12", nil},
	{"executeTemplate", `{{ define "custom" }}my custom template {{ . }}{{ end }}{{ executeTemplate "custom" }}|{{ executeTemplate "custom" 42 }}|{{ $v := executeTemplate "custom" "x" }}{{ $v }}`,
		"my custom template <no value>|my custom template 42|my custom template x", nil},
	{"key", `{{ key "service/redis/maxconns" }}`, "15", keyView("service/redis/maxconns", "15")},
	{"keyExists", `{{ if keyExists "app/beta_active" }}on{{ else }}off{{ end }} {{ keyExists "app/" }} {{ keyExists "nope/" }}`, "off true false", keyView("app/", "", "app/x", "1")},
	{"keyOrDefault", `{{ keyOrDefault "service/redis/maxconns" "5" }} {{ keyOrDefault "empty" "d" }} {{ keyOrDefault "set" "d" }}`, "5 d 7", keyView("empty", "", "set", "7")},
	{"ls", `{{ range ls "service/redis" }}{{ .Key }}:{{ .Value }} {{ end }}`, "maxconns:15 minconns:5 ", keyView("service/redis/maxconns", "15", "service/redis/minconns", "5", "service/redis/nested/x", "no", "service/redis/", "")},
	{"tree", `{{ range tree "service/redis" }}{{ .Key }}:{{ .Value }} {{ end }}`, "maxconns:12 minconns:2 nested/config/value:v ", keyView("service/redis/minconns", "2", "service/redis/maxconns", "12", "service/redis/nested/config/value", "v")},
	{"safeLs", `{{ range safeLs "service/redis" }}{{ .Key }}{{ end }}`, "a", keyView("service/redis/a", "1")},
	{"safeTree", `{{ range safeTree "service/redis" }}{{ .Key }}{{ end }}`, "a/b", keyView("service/redis/a/b", "1")},
}

func init() {
	// Outputs the docs do not give, computed with the standard library:
	// the hex digest of the input, and the HMAC of the message (first)
	// with the key (second).
	for i := range docCases {
		switch docCases[i].name {
		case "md5sum":
			sum := md5.Sum([]byte("myString"))
			docCases[i].want = hex.EncodeToString(sum[:])
		case "hmacSHA256Hex":
			mac := hmac.New(sha256.New, []byte("somekey"))
			mac.Write([]byte("somemessage"))
			docCases[i].want = hex.EncodeToString(mac.Sum(nil)) + " " + hex.EncodeToString(mac.Sum(nil))
		}
	}
}

// TestDocumentedFunctions renders every example of consul-template's
// templating language documentation and compares it with what the docs
// say it renders.
func TestDocumentedFunctions(t *testing.T) {
	for _, tc := range docCases {
		keys := tc.keys
		if keys == nil {
			keys = NewKeys()
		}
		got, err := run(t, tc.text, keys)
		if err != nil || got != tc.want {
			t.Errorf("%s: %s\n got %q, %v\nwant %q", tc.name, tc.text, got, err, tc.want)
		}
	}
}

// TestFunctionErrors: consul-template's functions fail where it does —
// parse* on bad input (sprig's return 0), a negative indent, integer
// division by zero, an empty safeLs.
func TestFunctionErrors(t *testing.T) {
	for text, want := range map[string]string{
		`{{ "x" | parseInt }}`:          `parseInt: strconv.ParseInt: parsing "x": invalid syntax`,
		`{{ "1.2.3" | parseFloat }}`:    "parseFloat",
		`{{ "maybe" | parseBool }}`:     "parseBool",
		`{{ "-1" | parseUint }}`:        "parseUint",
		`{{ "x" | indent -1 }}`:         "indent value must be a positive integer",
		`{{ 10 | divide 0 }}`:           "division by zero",
		`{{ 10 | modulo 0 }}`:           "division by zero",
		`{{ 1.5 | modulo 2 }}`:          "modulo: unknown type",
		`{{ "x" | add 1 }}`:             "add: unknown type",
		`{{ base64Decode "!!" }}`:       "base64Decode",
		`{{ "{" | parseJSON }}`:         "unexpected end of JSON input",
		`{{ safeLs "none" }}`:           `safeLs "none": no keys below it`,
		`{{ safeTree "none" }}`:         `safeTree "none": no keys below it`,
		`{{ loop 1 2 3 }}`:              "loop: wrong number of arguments",
		`{{ executeTemplate "x" 1 2 }}`: "executeTemplate: wrong number of arguments",
	} {
		if _, err := run(t, text, NewKeys()); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v; want an error with %q", text, err, want)
		}
	}
}

// TestKeysAsConsulTemplateSeesThem: entries carry .Key, .Value and .Path
// (the full key); keyOrDefault of an empty value gives the default;
// keyExists "dir/" is a folder marker; a rejected key says why; a
// datacenter suffix is refused, at parse time when it is written out and
// at render time when it is computed.
func TestKeysAsConsulTemplateSeesThem(t *testing.T) {
	k := NewKeys()
	k.Add("backends/web1", "apps/nginx/backends/web1", []byte("10.0.0.1"))
	k.AddFolder("backends/", "apps/nginx/backends/", nil)
	k.Add("legacy/app", "apps/nginx/legacy/app", []byte("x"))
	k.Reject("legacy/app/port", `path "legacy/app/port" lies below file "legacy/app"`)
	got, err := run(t, `{{ range ls "backends" }}{{ .Key }} {{ .Value }} {{ .Path }}{{ end }} {{ keyExists "backends/" }}`, k)
	if err != nil || got != "web1 10.0.0.1 apps/nginx/backends/web1 true" {
		t.Errorf("ls: %q, %v", got, err)
	}
	_, err = run(t, `{{ key "legacy/app/port" }}`, k)
	if err == nil || !strings.Contains(err.Error(), `key "legacy/app/port" was rejected, not projected: path "legacy/app/port" lies below file "legacy/app"`) {
		t.Errorf("a rejected key: %v", err)
	}
	if _, err := Parse("t", "{{ key \"x@dc1\" }}\n{{ ls \"y@dc2\" }}"); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "t:1:") || !strings.Contains(err.Error(), `datacenter = "dc1"`) {
		t.Errorf("x@dc1 written out: %v", err)
	}
	if _, err := run(t, `{{ key (printf "x@%s" "dc1") }}`, k); err == nil || !strings.Contains(err.Error(), "datacenter suffix") {
		t.Errorf("x@dc1 computed: %v", err)
	}
}
