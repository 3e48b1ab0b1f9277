package kvset

import (
	"bytes"
	"cmp"
	"math"
	"slices"
)

// Building a set: from a map, or from entries added one at a time.

// FromMap returns a set of m's entries, their values copied into one
// chunk.
func FromMap(m map[string][]byte) Set {
	keys := make([]string, 0, len(m))
	size := 0
	for k, v := range m {
		keys = append(keys, k)
		size += len(v)
	}
	slices.Sort(keys)
	b := NewBuilder(len(keys))
	b.Grow(size)
	for _, k := range keys {
		b.Add(k, m[k])
	}
	return b.Set()
}

// Builder makes a Set from entries added one at a time. The zero Builder
// is ready to use.
type Builder struct {
	keys   []byte
	ends   []uint32
	refs   []ref
	chunks [][]byte
	// cur is the last chunk, which values are appended to while its
	// capacity lasts.
	cur []byte
	// sorted is false once a key was added at or below the one before.
	sorted, added bool
}

// NewBuilder returns a Builder with room for n entries.
func NewBuilder(n int) *Builder {
	return &Builder{ends: make([]uint32, 0, n), refs: make([]ref, 0, n)}
}

// minChunk is the least a Builder allocates for values it was not told
// of (Grow), in bytes.
const minChunk = 4 << 10

// Len returns the number of entries added.
func (b *Builder) Len() int { return len(b.ends) }

// Grow makes room for n more bytes of values in one chunk, which the
// values added next fill: a reader that knows a page's value bytes makes
// its chunk exactly that size.
func (b *Builder) Grow(n int) {
	if cap(b.cur)-len(b.cur) >= n {
		return
	}
	b.newChunk(n)
}

// newChunk starts a chunk of n bytes.
func (b *Builder) newChunk(n int) {
	if len(b.chunks) > 0 {
		b.chunks[len(b.chunks)-1] = b.cur
	}
	b.cur = make([]byte, 0, n)
	b.chunks = append(b.chunks, b.cur)
}

// Add adds key with a copy of value. Keys may come in any order (in byte
// order the set is made without sorting); of a key added twice the later
// value is kept. It panics when the keys or a chunk's values pass 4 GiB
// (math.MaxUint32 bytes), which a process holds only once it holds that
// much of them.
func (b *Builder) Add(key string, value []byte) {
	b.checkKey(len(key))
	b.keys = append(b.keys, key...)
	b.endKey(len(key))
	b.addValue(value)
}

// AddBytes is Add with the key as bytes, which are copied.
func (b *Builder) AddBytes(key, value []byte) {
	b.checkKey(len(key))
	b.keys = append(b.keys, key...)
	b.endKey(len(key))
	b.addValue(value)
}

// checkKey panics when a key of n bytes would take the keys past 4 GiB.
func (b *Builder) checkKey(n int) {
	if uint64(len(b.keys))+uint64(n) > math.MaxUint32 {
		panic("kvset: a set's keys pass 4 GiB")
	}
}

// endKey records the end of the key of n bytes just appended to b.keys,
// and whether the keys are still in byte order.
func (b *Builder) endKey(n int) {
	start := len(b.keys) - n
	switch {
	case !b.added:
		b.sorted, b.added = true, true
	case b.sorted:
		prev := uint32(0)
		if len(b.ends) > 1 {
			prev = b.ends[len(b.ends)-2]
		}
		if bytes.Compare(b.keys[prev:start], b.keys[start:]) >= 0 {
			b.sorted = false
		}
	}
	b.ends = append(b.ends, uint32(len(b.keys)))
}

func (b *Builder) addValue(v []byte) {
	if uint64(len(v)) > math.MaxUint32 {
		panic("kvset: a value passes 4 GiB")
	}
	if len(v) == 0 {
		b.refs = append(b.refs, ref{})
		return
	}
	if cap(b.cur)-len(b.cur) < len(v) {
		b.newChunk(max(len(v), minChunk))
	}
	off := len(b.cur)
	b.cur = append(b.cur, v...)
	b.refs = append(b.refs, ref{chunk: uint32(len(b.chunks) - 1), off: uint32(off), n: uint32(len(v))})
}

// Set returns the set of the entries added and empties the builder. Its
// arrays are made at their exact size; a chunk's room that no value took
// is given back. Values added in key order into one chunk (Grow) make a
// packed set.
func (b *Builder) Set() Set {
	defer func() { *b = Builder{} }()
	if len(b.ends) == 0 {
		return Set{}
	}
	if len(b.chunks) > 0 {
		b.chunks[len(b.chunks)-1] = exact(b.cur)
	}
	s := Set{keys: string(b.keys), ends: exact(b.ends), refs: b.refs, chunks: exact(b.chunks)}
	if !b.sorted {
		s = s.sorted()
	}
	if s = s.packed(); s.refs != nil {
		s.refs = exact(s.refs)
	}
	return s
}

// sorted returns s, whose entries may be in any order with a key more
// than once, sorted by key; of equal keys the one at the higher index is
// kept.
func (s Set) sorted() Set {
	type entry struct {
		key string
		ref ref
	}
	all := make([]entry, len(s.ends))
	for i := range s.ends {
		all[i] = entry{s.Key(i), s.ref(i)}
	}
	slices.SortStableFunc(all, func(x, y entry) int { return cmp.Compare(x.key, y.key) })
	n := 0
	for i := range all {
		if i+1 < len(all) && all[i+1].key == all[i].key {
			continue
		}
		all[n] = all[i]
		n++
	}
	all = all[:n]
	size := 0
	for _, e := range all {
		size += len(e.key)
	}
	keys := make([]byte, 0, size)
	out := Set{ends: make([]uint32, n), refs: make([]ref, n), chunks: s.chunks}
	for i, e := range all {
		keys = append(keys, e.key...)
		out.ends[i] = uint32(len(keys))
		out.refs[i] = e.ref
	}
	out.keys = string(keys)
	return out
}

// exact returns s, or a copy of it when its array is larger than its
// length: a set keeps no room it will not use.
func exact[T any](s []T) []T {
	if cap(s) == len(s) {
		return s
	}
	return slices.Clone(s)
}
