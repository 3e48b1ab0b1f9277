package source

import (
	"slices"
	"strings"
)

// Grouping prefixes: a source that follows many prefixes reads and
// watches them through a few requests, each on the longest prefix a group
// of them has in common. The groups come from the prefixes' trie: prefixes
// that share less go to different groups, as long as there are groups to
// spare. A VM that follows "fleet/shared/" and "fleet/vm0042/" has two,
// not one on "fleet/" that every other VM's keys would wake and fill; a
// thousand prefixes "p0000/" to "p0999/" (ten branches at their first
// difference) share one.

// CoveringGroup returns the prefix in groups (Partition's) that prefix
// starts with, if any. Groups never start with one another, so there is
// at most one.
func CoveringGroup(groups []string, prefix string) (string, bool) {
	for _, g := range groups {
		if strings.HasPrefix(prefix, g) {
			return g, true
		}
	}
	return "", false
}

// Partition returns the prefixes of at most max groups that cover
// prefixes, sorted — the Consul source's blocking queries, the etcd
// source's watches: each group reads the longest prefix its members have
// in common, and no group's prefix starts with another's, so each prefix
// has exactly one. It starts from one group and splits the largest group that
// can be split — by the byte after its common prefix, unless one of its
// prefixes is that common prefix — while the split keeps the count within
// max.
func Partition(prefixes []string, max int) []string {
	prefixes = slices.Clone(prefixes)
	slices.Sort(prefixes)
	prefixes = slices.Compact(prefixes)
	if len(prefixes) == 0 {
		return nil
	}
	type group struct {
		members []string // sorted
		common  string
		final   bool
	}
	groups := []group{{members: prefixes, common: CommonPrefix(prefixes)}}
	for {
		best := -1
		for i, g := range groups {
			if !g.final && len(g.members) > 1 && (best < 0 || len(g.members) > len(groups[best].members)) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		g := groups[best]
		if g.members[0] == g.common { // sorted: the common prefix comes first
			groups[best].final = true
			continue
		}
		var parts []group
		for lo := 0; lo < len(g.members); {
			b := g.members[lo][len(g.common)]
			hi := lo + 1
			for hi < len(g.members) && g.members[hi][len(g.common)] == b {
				hi++
			}
			parts = append(parts, group{members: g.members[lo:hi], common: CommonPrefix(g.members[lo:hi])})
			lo = hi
		}
		if len(groups)-1+len(parts) > max {
			groups[best].final = true
			continue
		}
		groups = slices.Replace(groups, best, best+1, parts...)
	}
	out := make([]string, len(groups))
	for i, g := range groups {
		out[i] = g.common
	}
	slices.Sort(out)
	return out
}

// CommonPrefix returns the longest prefix of the sorted strings ss: that of
// the first and the last.
func CommonPrefix(ss []string) string {
	first, last := ss[0], ss[len(ss)-1]
	n := 0
	for n < len(first) && n < len(last) && first[n] == last[n] {
		n++
	}
	return first[:n]
}
