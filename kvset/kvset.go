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
// the worker at rest 20.3–20.7 MiB as sets with refs against 23.6–23.8
// as maps (BENCHMARKS.md, "The monitor's collector target, and the
// worker's snapshots as sorted sets").
package kvset

import (
	"bytes"
	"cmp"
	"iter"
	"math"
	"slices"
	"sort"
	"strings"
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

// Change is a change to one key of a set (With): Value is its new value,
// unless Delete.
type Change struct {
	Key    string
	Value  []byte
	Delete bool
}

// With returns the set with changes applied in their order (of two
// changes to one key the later wins), and whether it differs from s: a
// put of the value a key holds, or a delete of a key it lacks, changes
// nothing. s is not modified. The new set shares s's chunks, and its keys
// when no key is added or removed; the new values are copied into a chunk
// of their own.
func (s Set) With(changes []Change) (Set, bool) {
	if len(changes) == 0 {
		return s, false
	}
	// The last change of each key, in key order, that changes something.
	last := slices.Clone(changes)
	slices.SortStableFunc(last, func(x, y Change) int { return cmp.Compare(x.Key, y.Key) })
	n, sameKeys, size := 0, true, 0
	for i, c := range last {
		if i+1 < len(last) && last[i+1].Key == c.Key {
			continue
		}
		v, had := s.Get(c.Key)
		switch {
		case c.Delete && !had, !c.Delete && had && bytes.Equal(v, c.Value):
			continue
		case c.Delete || !had:
			sameKeys = false
		}
		if !c.Delete {
			size += len(c.Value)
		}
		last[n] = c
		n++
	}
	last = last[:n]
	if len(last) == 0 {
		return s, false
	}
	if uint64(size) > math.MaxUint32 {
		panic("kvset: a change's values pass 4 GiB")
	}
	chunk := make([]byte, 0, size)
	newRef := func(v []byte) ref {
		if len(v) == 0 {
			return ref{}
		}
		off := len(chunk)
		chunk = append(chunk, v...)
		return ref{chunk: uint32(len(s.chunks)), off: uint32(off), n: uint32(len(v))}
	}
	var next Set
	if sameKeys {
		next = Set{keys: s.keys, ends: s.ends, refs: s.ownRefs()}
		for _, c := range last {
			i, _ := s.find(c.Key)
			next.refs[i] = newRef(c.Value)
		}
	} else {
		// A merge of the two sorted lists.
		keys := make([]byte, 0, len(s.keys)+len(last)*8)
		next = Set{ends: make([]uint32, 0, s.Len()+len(last)), refs: make([]ref, 0, s.Len()+len(last))}
		put := func(key string, r ref) {
			if uint64(len(keys))+uint64(len(key)) > math.MaxUint32 {
				panic("kvset: a set's keys pass 4 GiB")
			}
			keys = append(keys, key...)
			next.ends = append(next.ends, uint32(len(keys)))
			next.refs = append(next.refs, r)
		}
		i := 0
		for _, c := range last {
			for ; i < s.Len() && s.Key(i) < c.Key; i++ {
				put(s.Key(i), s.ref(i))
			}
			if i < s.Len() && s.Key(i) == c.Key {
				i++
			}
			if !c.Delete {
				put(c.Key, newRef(c.Value))
			}
		}
		for ; i < s.Len(); i++ {
			put(s.Key(i), s.ref(i))
		}
		next.keys, next.ends, next.refs = string(keys), exact(next.ends), exact(next.refs)
	}
	next.chunks = make([][]byte, len(s.chunks), len(s.chunks)+1)
	copy(next.chunks, s.chunks)
	if len(chunk) > 0 {
		next.chunks = append(next.chunks, chunk)
	}
	return next.compacted(), true
}

// maxChunks is how many chunks a set holds before its smaller ones are
// merged (compacted).
const maxChunks = 8

// compacted returns s with its chunks merged when they hold more bytes
// that no value uses than values, with some slack (every value copied
// into one chunk), or when they are more than maxChunks (the values of
// every chunk but the largest copied into one): a set holds at most
// about twice its values' bytes, in few chunks, and the copies cost, over
// many changes, about the bytes the changes brought.
func (s Set) compacted() Set {
	if s.refs == nil {
		// Packed: its values fill its one chunk, or a part of one it
		// shares (Under).
		return s
	}
	held, live := s.heldBytes(), s.ValueBytes()
	switch {
	case held > 2*live+minChunk:
		return s.merged(func(int) bool { return true })
	case len(s.chunks) > maxChunks:
		largest := 0
		for i, c := range s.chunks {
			if len(c) > len(s.chunks[largest]) {
				largest = i
			}
		}
		return s.merged(func(i int) bool { return i != largest })
	}
	// Chunks no value refers to any longer are dropped.
	used := usedChunks(len(s.chunks), s.refs)
	if !slices.Contains(used, false) {
		return s
	}
	return s.merged(func(int) bool { return false })
}

// merged returns s with the values of the chunks merge reports true for
// copied into one new chunk, and the chunks no value refers to then
// dropped.
func (s Set) merged(merge func(chunk int) bool) Set {
	refs := s.ownRefs()
	size := 0
	for _, r := range refs {
		if r.n > 0 && merge(int(r.chunk)) {
			size += int(r.n)
		}
	}
	// Chunks kept as they are, renumbered, then the new one.
	renumber := make([]uint32, len(s.chunks))
	var chunks [][]byte
	used := usedChunks(len(s.chunks), refs)
	for i, c := range s.chunks {
		if used[i] && !merge(i) {
			renumber[i] = uint32(len(chunks))
			chunks = append(chunks, c)
		}
	}
	// One pass over the refs: a merged chunk's values copied into the
	// new one, the others' chunks renumbered.
	chunk, at := make([]byte, 0, size), uint32(len(chunks))
	for i, r := range refs {
		switch {
		case r.n == 0:
		case merge(int(r.chunk)):
			off := len(chunk)
			chunk = append(chunk, s.Value(i)...)
			refs[i] = ref{chunk: at, off: uint32(off), n: r.n}
		default:
			refs[i].chunk = renumber[r.chunk]
		}
	}
	if size > 0 {
		chunks = append(chunks, chunk)
	}
	return Set{keys: s.keys, ends: s.ends, refs: refs, chunks: exact(chunks)}.packed()
}

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

// usedChunks reports, for each of n chunks, whether one of refs refers
// to it.
func usedChunks(n int, refs []ref) []bool {
	used := make([]bool, n)
	for _, r := range refs {
		if r.n > 0 {
			used[r.chunk] = true
		}
	}
	return used
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
