package config

import (
	"fmt"
	"slices"
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

// plainFeed is a source that reaches its store over plain TCP
// (PlainTCP) and feeds mounts of root's: the mounts, by name, in the
// order of the file, and the section and key of the first, where the
// warning goes.
type plainFeed struct {
	source, endpoints string
	first             *Section
	key               string
	mounts            []string
}

// notePlainTCP adds m, a mount of root's in sec, to the feeds of its
// sources that reach their store over plain TCP, and returns feeds, a
// source's feed added when first met.
func notePlainTCP(feeds []*plainFeed, sec *Section, m *Mount, cfg *Config) []*plainFeed {
	key := "source"
	if sec.Has("projections") {
		key = "projections"
	}
	for _, pr := range m.Projections {
		src, ok := cfg.Sources[pr.Source]
		if !ok {
			continue
		}
		p, ok := src.Settings.(PlainTCP)
		if !ok {
			continue
		}
		eps := p.PlainTCP()
		if len(eps) == 0 {
			continue
		}
		i := slices.IndexFunc(feeds, func(f *plainFeed) bool { return f.source == pr.Source })
		if i < 0 {
			shown := make([]string, len(eps))
			for j, ep := range eps {
				shown[j] = origin.Redact(ep) // a query may carry a token
			}
			i, feeds = len(feeds), append(feeds, &plainFeed{source: pr.Source, endpoints: strings.Join(shown, ", "), first: sec, key: key})
		}
		if f := feeds[i]; len(f.mounts) == 0 || f.mounts[len(f.mounts)-1] != m.Name {
			f.mounts = append(f.mounts, m.Name)
		}
	}
	return feeds
}

// plainTCPShown is how many mounts a warning of plainFeed names before it
// counts the rest.
const plainTCPShown = 3

// warn warns once for f, at its first mount's source: a thousand mounts
// of one source are one warning, not a thousand at each start.
func (f *plainFeed) warn() {
	const risk = "a local user who takes that port while the store is down, or before it is up at boot, chooses %s; use TLS with a CA (tls.ca_file), a unix socket, or peer_user"
	if len(f.mounts) == 1 {
		f.first.Warnf(f.key, "mount %s is root's, and source %s feeds it over plain TCP (%s): "+risk, f.mounts[0], f.source, f.endpoints, "its content")
		return
	}
	names := strings.Join(f.mounts[:min(len(f.mounts), plainTCPShown)], ", ")
	if more := len(f.mounts) - plainTCPShown; more > 0 {
		names += fmt.Sprintf(" and %d more", more)
	}
	f.first.Warnf(f.key, "mounts %s are root's, and source %s feeds them over plain TCP (%s): "+risk, names, f.source, f.endpoints, "their content")
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
