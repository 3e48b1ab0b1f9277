package config

import (
	"strings"

	"github.com/kvmount/kvmount/origin"
)

// ProjectionDecoder is implemented by source settings whose projections
// read more than a prefix (a Vault source's [mount.pki]): DecodeProjection
// reads the projection's prefix and the keys of its own from sec — the
// mount's table for the shorthand, else a [[mount.projections]] table —
// reporting problems through it, and returns what the source follows: a
// prefix in the source's own syntax. m is the mount, decoded up to its
// projections (medium, user, immutable), for warnings.
type ProjectionDecoder interface {
	DecodeProjection(sec *Section, m *Mount) string
}

// ItemDefaulter is implemented by source settings whose projections have
// files of their own without items (a Vault source's PKI certificate):
// DefaultItems returns the items of the projection of prefix when its
// table gives none — such as a private key made 0600 unless m's
// default_mode is written —, nil for a projection of every key.
type ItemDefaulter interface {
	DefaultItems(prefix string, m *Mount) []Item
}

// sourceSettings returns src's settings; nil for a nil src.
func sourceSettings(src *Source) any {
	if src == nil {
		return nil
	}
	return src.Settings
}

// warnPlainTCP warns at the source of m, a mount of root's, fed by a
// source that reaches its store over plain TCP (PlainTCP).
func warnPlainTCP(sec *Section, m *Mount, cfg *Config) {
	key := "source"
	if sec.Has("projections") {
		key = "projections"
	}
	for _, pr := range m.Projections {
		src, ok := cfg.Sources[pr.Source]
		if !ok {
			continue
		}
		if p, ok := src.Settings.(PlainTCP); ok {
			if eps := p.PlainTCP(); len(eps) > 0 {
				shown := make([]string, len(eps))
				for i, ep := range eps {
					shown[i] = origin.Redact(ep) // a query may carry a token
				}
				sec.Warnf(key, "mount %s is root's, and source %s feeds it over plain TCP (%s): a local user who takes that port while the store is down, or before it is up at boot, chooses its content; use TLS with a CA (tls.ca_file), a unix socket, or peer_user", m.Name, pr.Source, strings.Join(shown, ", "))
			}
		}
	}
}

// PlainTCP is implemented by source settings that can reach their store
// over plain TCP, unauthenticated: it returns the endpoints reached so,
// without TLS and without a peer_user check. kvmount check warns about a
// mount of root's that such a source feeds: a local user who takes the
// port while the store is down, or before it is up at boot, chooses what
// the mount holds.
type PlainTCP interface {
	PlainTCP() []string
}

// StoreURLs is implemented by source settings: it returns the URLs the
// source connects to (etcd's endpoints, Consul's and Vault's address, the
// HTTP source's URL), for the worker's Landlock policy (privsep.PolicyFor).
type StoreURLs interface {
	StoreURLs() []string
}

// RereadFiles is implemented by source settings that read credential
// files again while the source runs (a Vault token_file a vault-agent
// sink rotates, AppRole's role_id_file and secret_id_file): it returns
// them. These, and no other file, are what a worker may ask the monitor
// to read for it (privsep).
type RereadFiles interface {
	RereadFiles() []string
}
