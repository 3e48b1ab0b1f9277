package render

import (
	"maps"
	"slices"
	"text/template"

	"github.com/Masterminds/sprig/v3"
)

// sprigFuncs are sprig's functions (github.com/Masterminds/sprig/v3), which
// templates call as sprig_<name> as in consul-template; those that read
// the clock, randomness, the environment or the network are in
// refusedFuncs as sprig_<name>.
//
// sprig's keys and values return a map's keys and values in Go's map
// order, which changes from run to run: here they come sorted by key, so
// that the same keys render the same bytes.
var sprigFuncs = func() map[string]any {
	fm := sprig.TxtFuncMap()
	out := make(map[string]any, len(fm))
	maps.Copy(out, fm)
	out["keys"] = func(dicts ...map[string]any) []string {
		var keys []string
		for _, d := range dicts {
			keys = append(keys, slices.Sorted(maps.Keys(d))...)
		}
		return keys
	}
	out["values"] = func(dict map[string]any) []any {
		var values []any
		for _, k := range slices.Sorted(maps.Keys(dict)) {
			values = append(values, dict[k])
		}
		return values
	}
	return out
}()

// refusedFuncs are the functions a template may not call, with why:
// consul-template's that read Consul's catalog, Vault, Nomad, the
// environment, the clock, files or the host, and sprig's that read the
// clock, randomness, the environment or the network. kvmount check refuses
// a template that calls one, at its line.
var refusedFuncs = func() map[string]string {
	r := map[string]string{}
	for reason, names := range map[string][]string{
		"it reads Consul's catalog, and kvmount reads keys only": {"datacenters", "service", "services", "connect", "node", "nodes", "partitions", "peerings",
			"exportedServices", "importedServices", "caRoots", "caLeaf", "byTag", "byPort", "byMeta"},
		"it lists Vault's secrets; secret reads those the mount's Vault projections read":                                                        {"secrets"},
		"it issues a certificate of its own: project one with [mount.pki], which switches certificate and key together, and read it with secret": {"pkiCert"},
		"it reads Nomad, and kvmount reads keys only":                                                                                            {"nomadServices", "nomadService", "nomadVarList", "nomadVarListSafe", "nomadVar", "nomadVarExists"},
		"it reads the environment":                                   {"env", "mustEnv", "envOrDefault", "sprig_env", "sprig_expandenv"},
		"it reads a file":                                            {"file"},
		"it writes a file":                                           {"writeToFile"},
		"it runs a program":                                          {"plugin"},
		"it reads the host's network interfaces":                     {"sockaddr"},
		"it looks a name up in DNS":                                  {"sprig_getHostByName"},
		"it prints memory addresses, which change from run to run":   {"spew_dump", "spew_printf", "spew_sdump", "spew_sprintf"},
		"it reads the clock":                                         {"timestamp", "sprig_now", "sprig_ago", "sprig_durationRound", "sprig_unixEpoch"},
		"it depends on the host's time zone":                         {"sprig_date", "sprig_htmlDate", "sprig_toDate", "sprig_mustToDate", "sprig_dateModify", "sprig_date_modify", "sprig_mustDateModify", "sprig_must_date_modify", "sprig_dateInZone", "sprig_date_in_zone", "sprig_htmlDateInZone"},
		"it uses randomness":                                         {"sprig_randAlpha", "sprig_randAlphaNum", "sprig_randAscii", "sprig_randNumeric", "sprig_randBytes", "sprig_randInt", "sprig_shuffle", "sprig_uuidv4"},
		"it uses randomness (a new key or certificate every render)": {"sprig_genPrivateKey", "sprig_genCA", "sprig_genCAWithKey", "sprig_genSelfSignedCert", "sprig_genSelfSignedCertWithKey", "sprig_genSignedCert", "sprig_genSignedCertWithKey"},
		"it uses randomness (a random salt or IV every render)":      {"sprig_htpasswd", "sprig_bcrypt", "sprig_encryptAES"},
	} {
		for _, name := range names {
			r[name] = reason
		}
	}
	return r
}()

// ctNames maps sprig's bare names, which kvmount templates had before, to
// consul-template's function of the same use, for parse errors' hints.
var ctNames = map[string]string{
	"upper": "toUpper", "lower": "toLower", "title": "toTitle", "trimAll": "trim", "trimall": "trim",
	"replace": "replaceAll", "b64enc": "base64Encode", "b64dec": "base64Decode",
	"toJson": "toJSON", "toPrettyJson": "toJSONPretty", "toRawJson": "toUnescapedJSON", "fromJson": "parseJSON",
	"sha256sum": "sha256Hex", "atoi": "parseInt", "int": "parseInt", "int64": "parseInt", "float64": "parseFloat",
	"sub": "subtract", "mul": "multiply", "div": "divide", "mod": "modulo", "min": "minimum", "max": "maximum",
	"until": "loop", "splitList": "split", "nindent": "indent",
}

// parseFuncs are every name a template may use, for parsing: the helpers,
// the key functions, sprig_<name>, executeTemplate, scratch, the printing
// builtins kvmount bounds, the refused functions (which inspect reports)
// and the tick. Execution uses each template's own bounded copies.
var parseFuncs = func() template.FuncMap {
	fm := template.FuncMap{tickName: func() string { return "" }}
	for name, fn := range helperFuncs() {
		fm[name] = fn
	}
	for name, fn := range sprigFuncs {
		fm["sprig_"+name] = fn
	}
	st := &state{}
	for name, fn := range st.keyFuncs() {
		fm[name] = fn
	}
	fm["secret"] = st.secretFunc
	fm["executeTemplate"] = func(string, ...any) (string, error) { return "", nil }
	fm["scratch"] = func() *Scratch { return nil }
	for name, fn := range printFuncs {
		fm[name] = fn
	}
	for name := range refusedFuncs {
		fm[name] = func(...any) (string, error) { return "", nil }
	}
	return fm
}()
