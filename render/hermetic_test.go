package render

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// sprigSamples call every sprig function a template may use (as
// sprig_<name>) on fixed arguments.
var sprigSamples = map[string]string{
	"abbrev": `{{ sprig_abbrev 5 "hello world" }}`, "abbrevboth": `{{ sprig_abbrevboth 5 10 "1234 5678 9123" }}`,
	"add": `{{ sprig_add 1 2 3 }}`, "add1": `{{ sprig_add1 1 }}`, "add1f": `{{ sprig_add1f 1.5 }}`, "addf": `{{ sprig_addf 1.5 2 }}`,
	"adler32sum": `{{ sprig_adler32sum "x" }}`, "all": `{{ sprig_all 1 "a" }}`, "any": `{{ sprig_any 0 "" 1 }}`,
	"append": `{{ sprig_append (sprig_list 1) 2 }}`, "atoi": `{{ sprig_atoi "12" }}`, "b32dec": `{{ sprig_b32dec "ME======" }}`,
	"b32enc": `{{ sprig_b32enc "a" }}`, "b64dec": `{{ sprig_b64dec "YQ==" }}`, "b64enc": `{{ sprig_b64enc "a" }}`, "base": `{{ sprig_base "/a/b.c" }}`,
	"biggest": `{{ sprig_biggest 1 5 3 }}`, "buildCustomCert": `{{ with sprig_buildCustomCert "x" "y" }}{{ end }}`,
	"camelcase": `{{ sprig_camelcase "http_server" }}`, "cat": `{{ sprig_cat "a" 1 }}`, "ceil": `{{ sprig_ceil 1.2 }}`,
	"chunk": `{{ sprig_chunk 2 (sprig_list 1 2 3) }}`, "clean": `{{ sprig_clean "a//b/../c" }}`, "coalesce": `{{ sprig_coalesce "" "x" }}`,
	"compact": `{{ sprig_compact (sprig_list 1 "" 2) }}`, "concat": `{{ sprig_concat (sprig_list 1) (sprig_list 2) }}`,
	"contains": `{{ sprig_contains "b" "abc" }}`, "decryptAES": `{{ sprig_decryptAES "secret" "" }}`,
	"deepCopy": `{{ sprig_deepCopy (sprig_dict "a" 1) }}`, "deepEqual": `{{ sprig_deepEqual (sprig_list 1) (sprig_list 1) }}`,
	"default": `{{ sprig_default "d" "" }}`, "derivePassword": `{{ sprig_derivePassword 1 "long" "password" "user" "example.com" }}`,
	"dict": `{{ sprig_dict "a" 1 "b" 2 }}`, "dig": `{{ sprig_dig "a" "b" "d" (sprig_dict "a" (sprig_dict "b" 1)) }}`,
	"dir": `{{ sprig_dir "/a/b" }}`, "div": `{{ sprig_div 7 2 }}`, "divf": `{{ sprig_divf 7 2 }}`, "duration": `{{ sprig_duration 95 }}`,
	"empty": `{{ sprig_empty "" }}`, "ext": `{{ sprig_ext "a.txt" }}`, "fail": `{{ if false }}{{ sprig_fail "no" }}{{ end }}`,
	"first": `{{ sprig_first (sprig_list 1 2) }}`, "float64": `{{ sprig_float64 "1.5" }}`, "floor": `{{ sprig_floor 1.5 }}`,
	"fromJson": `{{ (sprig_fromJson "{\"a\":1}").a }}`, "get": `{{ sprig_get (sprig_dict "a" 1) "a" }}`,
	"has": `{{ sprig_has 1 (sprig_list 1) }}`, "hasKey": `{{ sprig_hasKey (sprig_dict "a" 1) "a" }}`,
	"hasPrefix": `{{ sprig_hasPrefix "a" "ab" }}`, "hasSuffix": `{{ sprig_hasSuffix "b" "ab" }}`, "hello": `{{ sprig_hello }}`,
	"indent": `{{ sprig_indent 2 "a\nb" }}`, "initial": `{{ sprig_initial (sprig_list 1 2) }}`, "initials": `{{ sprig_initials "Ada Lovelace" }}`,
	"int": `{{ sprig_int "3" }}`, "int64": `{{ sprig_int64 "3" }}`, "isAbs": `{{ sprig_isAbs "/a" }}`, "join": `{{ sprig_join "," (sprig_list 1 2) }}`,
	"kebabcase": `{{ sprig_kebabcase "FirstName" }}`, "keys": `{{ sprig_keys (sprig_dict "b" 1 "a" 2 "c" 3) }}`, "kindIs": `{{ sprig_kindIs "int" 1 }}`,
	"kindOf": `{{ sprig_kindOf 1 }}`, "last": `{{ sprig_last (sprig_list 1 2) }}`, "list": `{{ sprig_list 1 2 }}`, "lower": `{{ sprig_lower "A" }}`,
	"max": `{{ sprig_max 1 3 2 }}`, "maxf": `{{ sprig_maxf 1 3.5 }}`, "merge": `{{ sprig_merge (sprig_dict "a" 1) (sprig_dict "b" 2) }}`,
	"mergeOverwrite": `{{ sprig_mergeOverwrite (sprig_dict "a" 1) (sprig_dict "a" 2) }}`, "min": `{{ sprig_min 3 1 }}`, "minf": `{{ sprig_minf 1.5 3 }}`,
	"mod": `{{ sprig_mod 7 3 }}`, "mul": `{{ sprig_mul 2 3 }}`, "mulf": `{{ sprig_mulf 1.5 2 }}`,
	"mustAppend": `{{ sprig_mustAppend (sprig_list 1) 2 }}`, "mustChunk": `{{ sprig_mustChunk 2 (sprig_list 1 2 3) }}`,
	"mustCompact": `{{ sprig_mustCompact (sprig_list 1 "") }}`, "mustDeepCopy": `{{ sprig_mustDeepCopy (sprig_list 1) }}`,
	"mustFirst": `{{ sprig_mustFirst (sprig_list 1) }}`, "mustFromJson": `{{ sprig_mustFromJson "[1]" }}`, "mustHas": `{{ sprig_mustHas 1 (sprig_list 1) }}`,
	"mustInitial": `{{ sprig_mustInitial (sprig_list 1 2) }}`, "mustLast": `{{ sprig_mustLast (sprig_list 1 2) }}`,
	"mustMerge": `{{ sprig_mustMerge (sprig_dict "a" 1) (sprig_dict "b" 2) }}`, "mustMergeOverwrite": `{{ sprig_mustMergeOverwrite (sprig_dict "a" 1) (sprig_dict "a" 2) }}`,
	"mustPrepend": `{{ sprig_mustPrepend (sprig_list 2) 1 }}`, "mustPush": `{{ sprig_mustPush (sprig_list 1) 2 }}`,
	"mustRegexFind": `{{ sprig_mustRegexFind "[0-9]+" "a12b" }}`, "mustRegexFindAll": `{{ sprig_mustRegexFindAll "[0-9]" "a1b2" -1 }}`,
	"mustRegexMatch": `{{ sprig_mustRegexMatch "^a" "ab" }}`, "mustRegexReplaceAll": `{{ sprig_mustRegexReplaceAll "a(x*)b" "-ab-axxb-" "${1}W" }}`,
	"mustRegexReplaceAllLiteral": `{{ sprig_mustRegexReplaceAllLiteral "a(x*)b" "-ab-axxb-" "${1}" }}`, "mustRegexSplit": `{{ sprig_mustRegexSplit "z+" "pizza" -1 }}`,
	"mustRest": `{{ sprig_mustRest (sprig_list 1 2) }}`, "mustReverse": `{{ sprig_mustReverse (sprig_list 1 2) }}`,
	"mustSlice": `{{ sprig_mustSlice (sprig_list 1 2 3) 1 }}`, "mustToJson": `{{ sprig_mustToJson (sprig_dict "a" 1) }}`,
	"mustToPrettyJson": `{{ sprig_mustToPrettyJson (sprig_dict "a" 1) }}`, "mustToRawJson": `{{ sprig_mustToRawJson (sprig_dict "a" "&") }}`,
	"mustUniq": `{{ sprig_mustUniq (sprig_list 1 1 2) }}`, "mustWithout": `{{ sprig_mustWithout (sprig_list 1 2) 1 }}`,
	"nindent": `{{ sprig_nindent 2 "a" }}`, "nospace": `{{ sprig_nospace "a b" }}`, "omit": `{{ sprig_omit (sprig_dict "a" 1 "b" 2) "a" }}`,
	"osBase": `{{ sprig_osBase "/a/b" }}`, "osClean": `{{ sprig_osClean "/a//b" }}`, "osDir": `{{ sprig_osDir "/a/b" }}`, "osExt": `{{ sprig_osExt "a.b" }}`,
	"osIsAbs": `{{ sprig_osIsAbs "/a" }}`, "pick": `{{ sprig_pick (sprig_dict "a" 1 "b" 2) "a" }}`,
	"pluck": `{{ sprig_pluck "a" (sprig_dict "a" 1) (sprig_dict "a" 2) }}`, "plural": `{{ sprig_plural "one" "many" 2 }}`,
	"prepend": `{{ sprig_prepend (sprig_list 2) 1 }}`, "push": `{{ sprig_push (sprig_list 1) 2 }}`, "quote": `{{ sprig_quote "a" }}`,
	"regexFind": `{{ sprig_regexFind "[0-9]+" "a12b" }}`, "regexFindAll": `{{ sprig_regexFindAll "[0-9]" "a1b2" -1 }}`,
	"regexMatch": `{{ sprig_regexMatch "^a" "ab" }}`, "regexQuoteMeta": `{{ sprig_regexQuoteMeta "1.2" }}`,
	"regexReplaceAll": `{{ sprig_regexReplaceAll "a(x*)b" "-ab-axxb-" "${1}W" }}`, "regexReplaceAllLiteral": `{{ sprig_regexReplaceAllLiteral "a(x*)b" "-ab-axxb-" "${1}" }}`,
	"regexSplit": `{{ sprig_regexSplit "z+" "pizza" -1 }}`, "repeat": `{{ sprig_repeat 3 "ab" }}`, "replace": `{{ sprig_replace "a" "b" "aaa" }}`,
	"rest": `{{ sprig_rest (sprig_list 1 2) }}`, "reverse": `{{ sprig_reverse (sprig_list 1 2) }}`, "round": `{{ sprig_round 1.2345 2 }}`,
	"semver": `{{ (sprig_semver "1.2.3").Major }}`, "semverCompare": `{{ sprig_semverCompare ">=1.2" "1.3.0" }}`, "seq": `{{ sprig_seq 1 3 }}`,
	"set": `{{ sprig_set (sprig_dict) "a" 1 }}`, "sha1sum": `{{ sprig_sha1sum "a" }}`, "sha256sum": `{{ sprig_sha256sum "a" }}`,
	"sha512sum": `{{ sprig_sha512sum "a" }}`, "slice": `{{ sprig_slice (sprig_list 1 2 3) 1 2 }}`, "snakecase": `{{ sprig_snakecase "FirstName" }}`,
	"sortAlpha": `{{ sprig_sortAlpha (sprig_list "b" "a") }}`, "split": `{{ (sprig_split "," "a,b")._1 }}`, "splitList": `{{ sprig_splitList "," "a,b" }}`,
	"splitn": `{{ (sprig_splitn "," 2 "a,b,c")._1 }}`, "squote": `{{ sprig_squote "a" }}`, "sub": `{{ sprig_sub 3 1 }}`, "subf": `{{ sprig_subf 3.5 1 }}`,
	"substr": `{{ sprig_substr 1 3 "hello" }}`, "swapcase": `{{ sprig_swapcase "Ab" }}`, "ternary": `{{ sprig_ternary "y" "n" true }}`,
	"title": `{{ sprig_title "ab cd" }}`, "toDecimal": `{{ sprig_toDecimal "0777" }}`, "toJson": `{{ sprig_toJson (sprig_list 1) }}`,
	"toPrettyJson": `{{ sprig_toPrettyJson (sprig_list 1) }}`, "toRawJson": `{{ sprig_toRawJson (sprig_list "&") }}`, "toString": `{{ sprig_toString 1 }}`,
	"toStrings": `{{ sprig_toStrings (sprig_list 1 2) }}`, "trim": `{{ sprig_trim " a " }}`, "trimAll": `{{ sprig_trimAll "$" "$5.00$" }}`,
	"trimPrefix": `{{ sprig_trimPrefix "a" "ab" }}`, "trimSuffix": `{{ sprig_trimSuffix "b" "ab" }}`, "trimall": `{{ sprig_trimall "$" "$5$" }}`,
	"trunc": `{{ sprig_trunc 2 "abc" }}`, "tuple": `{{ sprig_tuple 1 2 }}`, "typeIs": `{{ sprig_typeIs "int" 1 }}`, "typeIsLike": `{{ sprig_typeIsLike "int" 1 }}`,
	"typeOf": `{{ sprig_typeOf 1 }}`, "uniq": `{{ sprig_uniq (sprig_list 1 1) }}`, "unset": `{{ sprig_unset (sprig_dict "a" 1) "a" }}`,
	"until": `{{ sprig_until 3 }}`, "untilStep": `{{ sprig_untilStep 0 10 3 }}`, "untitle": `{{ sprig_untitle "Ab Cd" }}`, "upper": `{{ sprig_upper "a" }}`,
	"urlJoin": `{{ sprig_urlJoin (sprig_dict "host" "a" "scheme" "http") }}`, "urlParse": `{{ (sprig_urlParse "http://a/b").path }}`,
	"values": `{{ sprig_values (sprig_dict "b" 1 "a" 2 "c" 3) }}`, "without": `{{ sprig_without (sprig_list 1 2) 1 }}`,
	"wrap": `{{ sprig_wrap 3 "ab cd ef" }}`, "wrapWith": `{{ sprig_wrapWith 3 "|" "ab cd ef" }}`,
}

// otherSamples call the printing builtins kvmount bounds.
var otherSamples = map[string]string{
	"print": `{{ print "a" 1 }}`, "printf": `{{ printf "%05d %s" 7 "x" }}`, "println": `{{ println "a" }}`,
	"html": `{{ html "<a>" }}`, "js": `{{ js "a'b" }}`, "urlquery": `{{ urlquery "a b" }}`,
	"secret": `{{ with secret "kv/data/a" }}{{ .Data.data }}{{ end }}`,
}

// TestEveryFunctionIsHermetic enumerates the whole function map: each
// function is either in a deterministic list, with a sample that renders
// the same bytes again and again, or refused at parse time.
func TestEveryFunctionIsHermetic(t *testing.T) {
	documented := map[string]bool{}
	for _, tc := range docCases {
		documented[tc.name] = true
	}
	keys := keyView("a", "1", "dir/b", "2")
	keys.AddSecrets(Secrets{"kv/data/a": NewSecret("", 0, false, map[string]any{"data": map[string]any{"x": "1", "y": "2", "z": "3"}}, nil)})
	for _, name := range Names() {
		var sample string
		switch {
		case documented[name]:
			continue // TestDocumentedFunctions renders it, with its expected output
		case strings.HasPrefix(name, "sprig_"):
			sample = sprigSamples[strings.TrimPrefix(name, "sprig_")]
		default:
			sample = otherSamples[name]
		}
		if sample == "" {
			t.Errorf("%s is in the function map without a determinism test or a refusal", name)
			continue
		}
		first, err := run(t, sample, keys)
		if err != nil && name != "sprig_buildCustomCert" && name != "sprig_decryptAES" {
			t.Errorf("%s: %s: %v", name, sample, err)
			continue
		}
		for range 10 {
			if again, _ := run(t, sample, keys); again != first {
				t.Errorf("%s: %s rendered %q, then %q", name, sample, first, again)
				break
			}
		}
	}
	for name := range sprigSamples {
		if !slices.Contains(Names(), "sprig_"+name) {
			t.Errorf("sample for sprig_%s, which is not in the map", name)
		}
	}
	for name, why := range Refused() {
		text := "{{ " + name + " }}"
		if _, err := Parse("t", text); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), why) {
			t.Errorf("%s: %v; want it refused because %s", name, err, why)
		}
	}
	// The review's list: each refused.
	for _, name := range []string{"sprig_randInt", "sprig_shuffle", "sprig_genPrivateKey", "sprig_htpasswd", "sprig_bcrypt", "sprig_encryptAES", "sprig_ago", "sprig_now", "env", "file", "timestamp"} {
		if _, refused := Refused()[name]; !refused {
			t.Errorf("%s is not refused", name)
		}
	}
}

// TestSprigIsPrefixed: sprig's functions exist only as sprig_<name>; a
// bare sprig name that consul-template also has means consul-template's
// function (sprig's split returns a map, consul-template's a list), and one
// it does not have is undefined, with a hint.
func TestSprigIsPrefixed(t *testing.T) {
	got, err := run(t, `{{ range split "," "a,b,c,d,e,f,g,h,i,j,k" }}{{ . }}{{ end }}`, NewKeys())
	if err != nil || got != "abcdefghijk" {
		t.Errorf("split: %q, %v; want the list in order", got, err)
	}
	for bare, want := range map[string]string{"upper": "did you mean toUpper, or sprig_upper?", "b64enc": "did you mean base64Encode, or sprig_b64enc?", "hasPrefix": "did you mean sprig_hasPrefix?"} {
		if _, err := Parse("t", "x\n{{ "+bare+" \"a\" }}"); err == nil || !strings.Contains(err.Error(), "t:2:") || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v; want the line and %q", bare, err, want)
		}
	}
}
