package privsep

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kvmount/kvmount/config"
)

// Domain is a trust domain of a configuration: sources that some mount
// uses together, and the mounts that use them — a connected component of
// the graph whose nodes are sources and mounts, a mount joined to each
// source it projects. In the usual configuration each source is a domain
// of its own. One worker serves each domain: it holds that domain's
// credentials and data and no other's, and the monitor takes a mount's
// payload from the worker of the mount's domain only (SECURITY.md, "One
// worker per trust domain").
type Domain struct {
	// Name is the names of its sources, sorted, joined by "+"; a domain
	// keeps its name as long as its sources stay the same.
	Name string
	// Sources and Mounts are its sources' and mounts' names, sorted.
	Sources, Mounts []string
}

// Domains returns the trust domains of mounts and sources (every source
// configured; one no mount uses is a domain of its own, with no mount),
// by name.
func Domains(mounts []*config.Mount, sources []string) map[string]Domain {
	// Union-find over the sources: each mount joins those it projects.
	parent := map[string]string{}
	var find func(s string) string
	find = func(s string) string {
		p, ok := parent[s]
		if !ok || p == s {
			parent[s] = s
			return s
		}
		r := find(p)
		parent[s] = r
		return r
	}
	for _, s := range sources {
		find(s)
	}
	for _, m := range mounts {
		for i, pr := range m.Projections {
			a, b := find(m.Projections[0].Source), find(pr.Source)
			if i > 0 && a != b {
				parent[max(a, b)] = min(a, b)
			}
		}
	}
	members := map[string][]string{}
	for s := range parent {
		r := find(s)
		members[r] = append(members[r], s)
	}
	byRoot := map[string]*Domain{}
	for root, srcs := range members {
		slices.Sort(srcs)
		byRoot[root] = &Domain{Name: strings.Join(srcs, "+"), Sources: srcs}
	}
	for _, m := range mounts {
		if len(m.Projections) == 0 {
			continue
		}
		d := byRoot[find(m.Projections[0].Source)]
		d.Mounts = append(d.Mounts, m.Name)
	}
	out := make(map[string]Domain, len(byRoot))
	for _, d := range byRoot {
		slices.Sort(d.Mounts)
		out[d.Name] = *d
	}
	return out
}

// ConfigDomains returns the trust domains of cfg (Domains).
func ConfigDomains(cfg *config.Config) map[string]Domain {
	return Domains(cfg.Mounts, slices.Sorted(maps.Keys(cfg.Sources)))
}

// Of returns cfg with d's sources and mounts alone (the mounts in cfg's
// order); its other settings are cfg's.
func (d Domain) Of(cfg *config.Config) *config.Config {
	part := *cfg
	part.Sources = make(map[string]*config.Source, len(d.Sources))
	for _, s := range d.Sources {
		part.Sources[s] = cfg.Sources[s]
	}
	part.Mounts = slices.DeleteFunc(slices.Clone(cfg.Mounts), func(m *config.Mount) bool { return !slices.Contains(d.Mounts, m.Name) })
	return &part
}

// mountDomains returns the name of the domain of each mount and each
// source of domains.
func mountDomains(domains map[string]Domain) (mounts, sources map[string]string) {
	mounts, sources = map[string]string{}, map[string]string{}
	for name, d := range domains {
		for _, m := range d.Mounts {
			mounts[m] = name
		}
		for _, s := range d.Sources {
			sources[s] = name
		}
	}
	return mounts, sources
}

// DomainConfiguration returns what the worker of d is given to run cfg:
// the excerpt of cfg's text with d's sources and mounts alone
// (config.Excerpt), the files among inputs (what the monitor read for
// cfg, by name) that the excerpt names — a credential file of another
// domain never reaches it — and the limits of d's mounts. kinds are the
// source kinds' decoders: the excerpt is parsed here as the worker will
// parse it. It returns an error when the excerpt does not parse (a file
// the monitor did not read, say).
//
// A domain that holds every source and every mount of cfg — the only
// one, as a configuration without trust domains has — is given cfg's
// text and inputs as they are, and cfg is its share: its excerpt would
// be the same settings encoded anew. At 1,000 mounts the excerpt and its
// parse were two thirds of the 34–45 ms of CPU a start spent on its
// configuration before its worker could start, 12 ms without them
// (BenchmarkDomainConfiguration1000Mounts, BENCHMARKS.md).
func DomainConfiguration(cfg *config.Config, inputs map[string][]byte, kinds map[string]config.SourceDecoder, d Domain) (Configuration, *config.Config, error) {
	if holdsAll(cfg, d) {
		given := maps.Clone(inputs)
		given[cfg.Path] = cfg.Text
		return Configuration{Config: cfg.Path, Inputs: given, Mounts: Mounts(cfg.Mounts)}, cfg, nil
	}
	text, err := config.Excerpt(cfg.Text, d.Sources, d.Mounts)
	if err != nil {
		return Configuration{}, nil, err
	}
	rec := &config.Recorder{Files: config.Replay(inputs)}
	part, err := config.ParseWith(cfg.Path, text, kinds, rec)
	if err != nil {
		return Configuration{}, nil, fmt.Errorf("the configuration of domain %s: %w", d.Name, err)
	}
	given := rec.Recorded()
	given[cfg.Path] = text
	return Configuration{Config: cfg.Path, Inputs: given, Mounts: Mounts(part.Mounts)}, part, nil
}

// holdsAll reports whether d has every source and every mount of cfg.
func holdsAll(cfg *config.Config, d Domain) bool {
	if len(d.Sources) != len(cfg.Sources) || len(d.Mounts) != len(cfg.Mounts) {
		return false
	}
	for _, s := range d.Sources {
		if _, ok := cfg.Sources[s]; !ok {
			return false
		}
	}
	names := make(map[string]bool, len(cfg.Mounts))
	for _, m := range cfg.Mounts {
		names[m.Name] = true
	}
	for _, m := range d.Mounts {
		if !names[m] {
			return false
		}
		delete(names, m) // a name twice in d.Mounts leaves one of cfg's out
	}
	return len(names) == 0
}
