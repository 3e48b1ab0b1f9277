package kvset

import (
	"slices"
	"sort"
	"strings"
)

// Parts of a set that share its chunks: the entries under a prefix, and
// those a filter keeps.

// Under returns the entries whose keys begin with prefix, their keys
// relative to it, sharing s's chunks as they are: a set of every key of a
// document, such as an HTTP source's body, gives each prefix its part
// without a copy of the values.
func (s Set) Under(prefix string) Set {
	from := sort.Search(s.Len(), func(i int) bool { return s.Key(i) >= prefix })
	to := from
	size := 0
	for ; to < s.Len() && strings.HasPrefix(s.Key(to), prefix); to++ {
		size += len(s.Key(to)) - len(prefix)
	}
	if to == from {
		return Set{}
	}
	keys := make([]byte, 0, size)
	out := Set{ends: make([]uint32, to-from), chunks: s.chunks}
	if s.refs != nil {
		out.refs = slices.Clone(s.refs[from:to])
	} else {
		// Packed, as s is: its values are the run of s's from from to to.
		out.vends, out.vstart = s.vends[from:to:to], s.vstart
		if from > 0 {
			out.vstart = s.vends[from-1]
		}
	}
	for i := from; i < to; i++ {
		keys = append(keys, s.Key(i)[len(prefix):]...)
		out.ends[i-from] = uint32(len(keys))
	}
	out.keys = string(keys)
	return out
}

// Filter returns the set of the entries keep reports true for, and
// whether any was left out. It shares s's chunks, compacted when what it
// leaves out held most of their bytes.
func (s Set) Filter(keep func(key string, value []byte) bool) (Set, bool) {
	var b *Builder
	var kept []ref
	for i := range s.ends {
		k, v := s.Key(i), s.Value(i)
		ok := keep(k, v)
		if !ok && b == nil {
			b = NewBuilder(s.Len())
			for j := range i {
				b.keys = append(b.keys, s.Key(j)...)
				b.endKey(len(s.Key(j)))
			}
			for j := range i {
				kept = append(kept, s.ref(j))
			}
		}
		if ok && b != nil {
			b.keys = append(b.keys, k...)
			b.endKey(len(k))
			kept = append(kept, s.ref(i))
		}
	}
	if b == nil {
		return s, false
	}
	if len(kept) == 0 {
		return Set{}, true
	}
	out := Set{keys: string(b.keys), ends: exact(b.ends), refs: exact(kept), chunks: s.chunks}
	return out.compacted(), true
}
