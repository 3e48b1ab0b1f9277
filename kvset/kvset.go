// Package kvset holds the entries of one prefix — its keys, relative to
// the prefix, and their values — as an immutable set sorted by key, packed
// into a few allocations whatever its size: what a snapshot holds
// (source.Snapshot) and a projection reads (projector.Projection).
//
// A Go map from 100 keys to their values is a table of 5,248 bytes, 52
// bytes a key beside the keys' and values' own bytes, and each value is
// an allocation of its own or keeps alive the buffer it was read into. A
// Set keeps its keys one after the other in one string, with the end of
// each (4 bytes a key), and its values in chunks, each value found by its
// chunk, offset and length (12 bytes a key) — or, when its values sit in
// key order one after the other in one chunk, as a read makes them
// (Builder.Set), a prefix's part of such a set is (Under) and a
// compaction into one chunk leaves them, by the end of each (4 bytes a
// key: the packed form). A set made from another by changing some values
// (With) shares the other's chunks and adds one of the new values;
// chunks are merged when they grow many or hold more bytes no value uses
// than values (compaction), so that a set holds at most about twice its
// values' bytes, and a change copies the bytes of the values it changes,
// amortized, not the whole set. Measured at 1,000 prefixes of 100 keys of
// 75 bytes: 9.9 MB as packed sets, 10.7 MB with a ref for every value,
// against 14.5 MB as the etcd source's maps held them (TestSetHoldsLess);
// the worker at 1,000 such prefixes, at rest, 19.2–19.6 MiB as packed
// sets, 20.3–20.7 with a ref for every value, 23.6–23.8 as maps
// (BENCHMARKS.md, "The monitor's collector target, and the worker's
// snapshots as sorted sets").
package kvset

import (
	"bytes"
	"iter"
	"slices"
	"sort"
)

// Set is an immutable set of entries, sorted by key, each key once. The
// zero Set is empty. A Set is a value: copying it copies four slice
// headers, not the entries.
type Set struct {
	// keys is every key, one after the other in byte order; ends[i] is
	// where key i ends in it (it starts where key i-1 ends).
	keys string
	ends []uint32
	// refs[i] is where the value of key i is in chunks. When refs is nil
	// the set is packed: value i is chunks[0][start:vends[i]], where start
	// is vends[i-1], or vstart for the first (ref). No chunk is ever
	// written once a set refers to it.
	refs   []ref
	vends  []uint32
	vstart uint32
	chunks [][]byte
}

// ref is where one value is: chunks[chunk][off:off+n]. An empty value's
// ref is the zero ref, which refers to no chunk.
type ref struct{ chunk, off, n uint32 }

// empty is the value of an empty value's ref: not nil, since the key
// exists.
var empty = []byte{}

// Len returns the number of entries.
func (s Set) Len() int { return len(s.ends) }

// ref returns where the value of entry i is.
func (s Set) ref(i int) ref {
	if s.refs != nil {
		return s.refs[i]
	}
	start := s.vstart
	if i > 0 {
		start = s.vends[i-1]
	}
	if s.vends[i] == start {
		return ref{}
	}
	return ref{off: start, n: s.vends[i] - start}
}

// ownRefs returns every entry's ref in a slice of the caller's own.
func (s Set) ownRefs() []ref {
	if s.refs != nil {
		return slices.Clone(s.refs)
	}
	refs, start := make([]ref, len(s.ends)), s.vstart
	for i, end := range s.vends {
		if end > start {
			refs[i] = ref{off: start, n: end - start}
		}
		start = end
	}
	return refs
}

// packed returns s in the packed form when its values sit in key order
// one after the other in its one chunk, else s as it is.
func (s Set) packed() Set {
	if s.refs == nil || len(s.chunks) > 1 {
		return s
	}
	start := uint32(0)
	for _, r := range s.refs {
		if r.n > 0 {
			start = r.off
			break
		}
	}
	vends, end := make([]uint32, len(s.refs)), start
	for i, r := range s.refs {
		if r.n > 0 {
			if r.off != end {
				return s
			}
			end += r.n
		}
		vends[i] = end
	}
	s.refs, s.vends, s.vstart = nil, vends, start
	return s
}

// Key returns the key of entry i (0 ≤ i < Len), in byte order.
func (s Set) Key(i int) string {
	start := uint32(0)
	if i > 0 {
		start = s.ends[i-1]
	}
	return s.keys[start:s.ends[i]]
}

// Value returns the value of entry i (0 ≤ i < Len), capped to its length
// so that an append cannot reach its neighbours. The caller must not
// change its bytes.
func (s Set) Value(i int) []byte {
	r := s.ref(i)
	if r.n == 0 {
		return empty[:0:0]
	}
	end := r.off + r.n
	return s.chunks[r.chunk][r.off:end:end]
}

// Get returns the value of key and whether the set holds key. The caller
// must not change its bytes.
func (s Set) Get(key string) ([]byte, bool) {
	i, ok := s.find(key)
	if !ok {
		return nil, false
	}
	return s.Value(i), true
}

// ValueOf returns the value of key, nil when the set does not hold it.
// The caller must not change its bytes.
func (s Set) ValueOf(key string) []byte {
	v, _ := s.Get(key)
	return v
}

// Has reports whether the set holds key.
func (s Set) Has(key string) bool {
	_, ok := s.find(key)
	return ok
}

// find returns the index of key, or where it would go, and whether the
// set holds it.
func (s Set) find(key string) (int, bool) {
	i := sort.Search(len(s.ends), func(i int) bool { return s.Key(i) >= key })
	return i, i < len(s.ends) && s.Key(i) == key
}

// All returns an iterator over the entries, in key order.
func (s Set) All() iter.Seq2[string, []byte] {
	return func(yield func(string, []byte) bool) {
		for i := range s.ends {
			if !yield(s.Key(i), s.Value(i)) {
				return
			}
		}
	}
}

// Keys returns an iterator over the keys, in byte order.
func (s Set) Keys() iter.Seq[string] {
	return func(yield func(string) bool) {
		for i := range s.ends {
			if !yield(s.Key(i)) {
				return
			}
		}
	}
}

// ValueBytes returns the bytes of every value together.
func (s Set) ValueBytes() int64 {
	if s.refs == nil {
		if len(s.vends) == 0 {
			return 0
		}
		return int64(s.vends[len(s.vends)-1] - s.vstart)
	}
	var n int64
	for _, r := range s.refs {
		n += int64(r.n)
	}
	return n
}

// heldBytes returns the bytes of s's chunks, used by a value or not.
func (s Set) heldBytes() int64 {
	var n int64
	for _, c := range s.chunks {
		n += int64(cap(c))
	}
	return n
}

// Map returns the entries as a new map, for what needs one (tests, a
// template's view); the values are the set's own bytes.
func (s Set) Map() map[string][]byte {
	m := make(map[string][]byte, s.Len())
	for k, v := range s.All() {
		m[k] = v
	}
	return m
}

// Equal reports whether a and b hold the same keys with the same bytes.
func Equal(a, b Set) bool {
	if a.Len() != b.Len() || a.keys != b.keys || !slices.Equal(a.ends, b.ends) {
		return false
	}
	for i := range a.ends {
		if !bytes.Equal(a.Value(i), b.Value(i)) {
			return false
		}
	}
	return true
}
