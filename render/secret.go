package render

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"text/template/parse"
)

// Secret is one secret a source read whole from Vault, as a template's
// secret function returns it: consul-template's dependency.Secret, of which
// templates use Data — for a KV v2 secret {"data": its fields, "metadata":
// its version's metadata}, for KV v1, PKI and other engines the response's
// data — and the lease.
type Secret struct {
	// LeaseID names the lease the secret was read under ("" for none).
	LeaseID string
	// LeaseDuration is the lease's length, in seconds.
	LeaseDuration int
	// Renewable reports whether the lease can be renewed.
	Renewable bool
	// Data is the response's data as JSON decoded it (numbers as
	// json.Number, as the Vault API client decodes them).
	Data map[string]any
	// Warnings are the response's warnings.
	Warnings []string

	// params are the parameters of the write that made the secret (a
	// PKI issue's common_name, alt_names, ttl); nil for a read.
	params map[string]string
}

// NewSecret returns a secret that a write with params made (a PKI issue's
// common_name, alt_names, ttl); a template's secret call with parameters
// must name the same ones. params is not copied.
func NewSecret(leaseID string, leaseDuration int, renewable bool, data map[string]any, params map[string]string) *Secret {
	return &Secret{LeaseID: leaseID, LeaseDuration: leaseDuration, Renewable: renewable, Data: data, params: params}
}

// Secrets are the secrets of one projection, by every path a template may
// name one with (a KV v2 secret both as "secret/data/app/db", its API path,
// and as "secret/app/db", which consul-template accepts too).
type Secrets map[string]*Secret

// AddSecrets makes the secrets of a projection readable by the secret
// function; a path already added stays as it was.
func (k *Keys) AddSecrets(s Secrets) {
	if k.secrets == nil {
		k.secrets = Secrets{}
	}
	for p, sec := range s {
		if _, ok := k.secrets[p]; !ok {
			k.secrets[p] = sec
		}
	}
}

// secretFuncs names the functions that read the mount's secrets: their
// results are the mount's own data, as the key functions'.
var secretFuncs = map[string]bool{"secret": true}

// secretFunc is consul-template's secret: secret PATH returns the secret a
// Vault projection of the mount read at PATH; secret PATH "k=v"... names a
// write (a PKI issue), whose parameters must be those the projection
// issues with. A path no projection holds is an error (consul-template
// would wait for it): the mount keeps its last content.
func (st *state) secretFunc(p string, args ...string) (*Secret, error) {
	clean := strings.Trim(p, "/")
	st.read[secretRead+clean] = true
	s, ok := st.keys.secrets[clean]
	if !ok {
		return nil, fmt.Errorf("secret %q: no Vault projection of the mount holds it (a template reads only what the mount's projections read)", p)
	}
	if len(args) == 0 {
		return s, nil
	}
	if s.params == nil {
		return nil, fmt.Errorf("secret %q: the mount's projection reads it; parameters (%s) are for a write, such as a PKI issue", p, strings.Join(args, " "))
	}
	for _, a := range args {
		k, v, ok := strings.Cut(a, "=")
		if !ok {
			return nil, fmt.Errorf("secret %q: parameter %q is not KEY=VALUE", p, a)
		}
		if have, set := s.params[k]; !set || have != v {
			return nil, fmt.Errorf("secret %q: parameter %s=%q differs from the mount's projection, which issues with %s", p, k, v, describeParams(s.params))
		}
	}
	return s, nil
}

// describeParams lists params as k="v", sorted.
func describeParams(params map[string]string) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(params)) {
		out = append(out, fmt.Sprintf("%s=%q", k, params[k]))
	}
	return strings.Join(out, " ")
}

// secretRead prefixes the path of a secret a render read, in what
// Execute reports as read.
const secretRead = "\x00secret:"

// secretSignature returns what a template saw of the secret at p: its
// lease and data as fmt prints them (maps in key order), or "\x00".
func secretSignature(keys *Keys, p string) string {
	s, ok := keys.secrets[p]
	if !ok {
		return "\x00"
	}
	return fmt.Sprintf("s%s\x00%d\x00%t\x00%v\x00%q", s.LeaseID, s.LeaseDuration, s.Renewable, s.Data, s.Warnings)
}

// SecretCall is one call of the secret function in a template, for kvmount
// check: the path and parameters when they are string literals.
type SecretCall struct {
	// Path is the path named, "" when it is not a string literal.
	Path string
	// Params are the parameters that are string literals.
	Params []string
	// Line is the call's line in the template.
	Line int
}

// SecretCalls returns the template's calls of secret, in order.
func (t *Template) SecretCalls() []SecretCall { return slices.Clone(t.secretCalls) }

// secretCall returns the call of secret that the command's arguments
// from i (the function's name) make: the path when the argument right after
// the name is a string literal (the only form consul-template documents),
// and the parameters that are.
func secretCall(tree *parse.Tree, args []parse.Node, i int) SecretCall {
	call := SecretCall{Line: lineOf(tree, args[i])}
	if i+1 < len(args) {
		if s, ok := args[i+1].(*parse.StringNode); ok {
			call.Path = s.Text
		}
		for _, arg := range args[i+2:] {
			if s, ok := arg.(*parse.StringNode); ok {
				call.Params = append(call.Params, s.Text)
			}
		}
	}
	return call
}

// lineOf returns the line of n in tree's text.
func lineOf(tree *parse.Tree, n parse.Node) int {
	loc, _ := tree.ErrorContext(n)
	// loc is "NAME:LINE:COL".
	parts := strings.Split(loc, ":")
	if len(parts) < 3 {
		return 0
	}
	var line int
	fmt.Sscanf(parts[len(parts)-2], "%d", &line)
	return line
}
