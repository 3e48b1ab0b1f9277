package kvset

import (
	"bytes"
	"cmp"
	"math"
	"slices"
)

// A set made from another: with changes folded in, then compacted.

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
