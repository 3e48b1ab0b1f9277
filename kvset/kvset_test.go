package kvset

import (
	"bytes"
	"fmt"
	"maps"
	"runtime"
	"slices"
	"strings"
	"testing"
)

// entriesOf returns s as key=value strings, in its order.
func entriesOf(s Set) []string {
	var out []string
	for k, v := range s.All() {
		out = append(out, k+"="+string(v))
	}
	return out
}

func TestBuilder(t *testing.T) {
	for _, tc := range []struct {
		name string
		add  [][2]string
		want []string
	}{
		{"empty", nil, nil},
		{"sorted", [][2]string{{"a", "1"}, {"b", "2"}, {"c/d", "3"}}, []string{"a=1", "b=2", "c/d=3"}},
		{"unsorted", [][2]string{{"c", "3"}, {"a", "1"}, {"b", "2"}}, []string{"a=1", "b=2", "c=3"}},
		{"a key twice: the later wins", [][2]string{{"a", "1"}, {"b", "2"}, {"a", "3"}}, []string{"a=3", "b=2"}},
		{"a key twice in a row", [][2]string{{"a", "1"}, {"a", "2"}}, []string{"a=2"}},
		{"the empty key", [][2]string{{"b", "2"}, {"", "0"}}, []string{"=0", "b=2"}},
		{"a prefix of another", [][2]string{{"ab", "2"}, {"a", "1"}, {"a/", "3"}}, []string{"a=1", "a/=3", "ab=2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b Builder
			for _, kv := range tc.add {
				b.Add(kv[0], []byte(kv[1]))
			}
			s := b.Set()
			if got := entriesOf(s); !slices.Equal(got, tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
			if s.Len() != len(tc.want) {
				t.Errorf("Len = %d, want %d", s.Len(), len(tc.want))
			}
			if b.Len() != 0 {
				t.Errorf("the builder holds %d entries after Set, want 0", b.Len())
			}
		})
	}
}

func TestGet(t *testing.T) {
	s := FromMap(map[string][]byte{"a": []byte("1"), "b/c": []byte("2"), "": []byte("0"), "z": nil})
	for _, tc := range []struct {
		key   string
		value string
		ok    bool
	}{{"a", "1", true}, {"b/c", "2", true}, {"", "0", true}, {"z", "", true}, {"b", "", false}, {"b/c/", "", false}, {"zz", "", false}} {
		v, ok := s.Get(tc.key)
		if string(v) != tc.value || ok != tc.ok {
			t.Errorf("Get(%q) = %q, %v; want %q, %v", tc.key, v, ok, tc.value, tc.ok)
		}
		if s.Has(tc.key) != tc.ok {
			t.Errorf("Has(%q) = %v, want %v", tc.key, !tc.ok, tc.ok)
		}
	}
	if got, want := slices.Collect(s.Keys()), []string{"", "a", "b/c", "z"}; !slices.Equal(got, want) {
		t.Errorf("Keys = %q, want %q", got, want)
	}
	if got := s.ValueBytes(); got != 3 {
		t.Errorf("ValueBytes = %d, want 3", got)
	}
	var zero Set
	if _, ok := zero.Get("a"); ok || zero.Len() != 0 || len(zero.Map()) != 0 {
		t.Error("the zero Set is not empty")
	}
}

func TestWith(t *testing.T) {
	base := FromMap(map[string][]byte{"a": []byte("1"), "b": []byte("2"), "d": []byte("4")})
	for _, tc := range []struct {
		name     string
		changes  []Change
		want     []string
		changed  bool
		sameKeys bool
	}{
		{"nothing", nil, []string{"a=1", "b=2", "d=4"}, false, true},
		{"a value changed", []Change{{Key: "b", Value: []byte("20")}}, []string{"a=1", "b=20", "d=4"}, true, true},
		{"the same value", []Change{{Key: "b", Value: []byte("2")}}, []string{"a=1", "b=2", "d=4"}, false, true},
		{"a key added", []Change{{Key: "c", Value: []byte("3")}}, []string{"a=1", "b=2", "c=3", "d=4"}, true, false},
		{"a key added first and last", []Change{{Key: "e", Value: []byte("5")}, {Key: "0", Value: []byte("0")}}, []string{"0=0", "a=1", "b=2", "d=4", "e=5"}, true, false},
		{"a key deleted", []Change{{Key: "a", Delete: true}}, []string{"b=2", "d=4"}, true, false},
		{"a missing key deleted", []Change{{Key: "c", Delete: true}}, []string{"a=1", "b=2", "d=4"}, false, true},
		{"every key deleted", []Change{{Key: "d", Delete: true}, {Key: "b", Delete: true}, {Key: "a", Delete: true}}, nil, true, false},
		{"put then deleted", []Change{{Key: "c", Value: []byte("3")}, {Key: "c", Delete: true}}, []string{"a=1", "b=2", "d=4"}, false, true},
		{"deleted then put", []Change{{Key: "a", Delete: true}, {Key: "a", Value: []byte("10")}}, []string{"a=10", "b=2", "d=4"}, true, true},
		{"two puts: the later wins", []Change{{Key: "d", Value: []byte("x")}, {Key: "d", Value: []byte("y")}}, []string{"a=1", "b=2", "d=y"}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			next, changed := base.With(tc.changes)
			if got := entriesOf(next); !slices.Equal(got, tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
			if changed != tc.changed {
				t.Errorf("changed = %v, want %v", changed, tc.changed)
			}
			if Equal(next, base) == changed {
				t.Errorf("Equal(next, base) = %v with changed %v", !changed, changed)
			}
			if tc.sameKeys && changed && next.keys != base.keys {
				t.Error("the keys were copied where none was added or removed")
			}
			if got := entriesOf(base); !slices.Equal(got, []string{"a=1", "b=2", "d=4"}) {
				t.Errorf("the base set changed: %q", got)
			}
		})
	}
}

func TestFilter(t *testing.T) {
	base := FromMap(map[string][]byte{"a": []byte("1"), "b": []byte("22"), "c": []byte("3"), "d": []byte("44")})
	short := func(_ string, v []byte) bool { return len(v) < 2 }
	s, dropped := base.Filter(short)
	if got, want := entriesOf(s), []string{"a=1", "c=3"}; !slices.Equal(got, want) || !dropped {
		t.Errorf("Filter = %q, %v; want %q, true", got, dropped, want)
	}
	all, dropped := base.Filter(func(string, []byte) bool { return true })
	if !Equal(all, base) || dropped {
		t.Errorf("Filter keeping all = %q, %v", entriesOf(all), dropped)
	}
}

func TestEqual(t *testing.T) {
	a := FromMap(map[string][]byte{"a": []byte("1"), "b": []byte("2")})
	for _, tc := range []struct {
		b    map[string][]byte
		want bool
	}{
		{map[string][]byte{"a": []byte("1"), "b": []byte("2")}, true},
		{map[string][]byte{"a": []byte("1"), "b": []byte("3")}, false},
		{map[string][]byte{"a": []byte("1"), "c": []byte("2")}, false},
		{map[string][]byte{"a": []byte("1")}, false},
		{map[string][]byte{"ab": []byte("1"), "": []byte("2")}, false},
	} {
		if got := Equal(a, FromMap(tc.b)); got != tc.want {
			t.Errorf("Equal(%q, %q) = %v, want %v", entriesOf(a), tc.b, got, tc.want)
		}
	}
	if !Equal(Set{}, FromMap(nil)) {
		t.Error("two empty sets differ")
	}
}

func TestFromMapAndMap(t *testing.T) {
	m := map[string][]byte{}
	for i := range 300 {
		m[fmt.Sprintf("k/%03d", (i*7)%300)] = fmt.Appendf(nil, "v%d", i)
	}
	s := FromMap(m)
	if !maps.EqualFunc(s.Map(), m, func(a, b []byte) bool { return string(a) == string(b) }) {
		t.Error("Map(FromMap(m)) is not m")
	}
	if !slices.IsSorted(slices.Collect(s.Keys())) {
		t.Error("the keys are not sorted")
	}
}

// TestSetHoldsLess measures what 1,000 prefixes of 100 keys of 75 bytes
// hold as sets, beside the same entries in maps laid out as the etcd
// source kept them before sets (each prefix's keys in one string and its
// values in one buffer, a map of them): it fails unless the sets hold at
// least 30 % less (read in key order they are packed: 68 % of the maps;
// with a ref for every value they were 74 %).
func TestSetHoldsLess(t *testing.T) {
	const prefixes, keys = 1000, 100
	value := bytes.Repeat([]byte("v"), 75)
	key := func(i int) string { return fmt.Sprintf("key-%03d", i) }
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	inMaps := make([]map[string][]byte, prefixes)
	for p := range inMaps {
		var all strings.Builder
		values := make([]byte, 0, keys*len(value))
		for i := range keys {
			all.WriteString(key(i))
			values = append(values, value...)
		}
		packed := all.String()
		inMaps[p] = make(map[string][]byte, keys)
		for i := range keys {
			n := len(key(i))
			inMaps[p][packed[i*n:(i+1)*n]] = values[i*len(value) : (i+1)*len(value) : (i+1)*len(value)]
		}
	}
	mapBytes := heap() - before
	runtime.KeepAlive(inMaps)
	inMaps = nil
	before = heap()
	sets := make([]Set, prefixes)
	for p := range sets {
		b := NewBuilder(keys)
		b.Grow(keys * len(value))
		for i := range keys {
			b.Add(key(i), value)
		}
		sets[p] = b.Set()
	}
	setBytes := heap() - before
	runtime.KeepAlive(sets)
	t.Logf("%d prefixes of %d keys of %d bytes: maps %d bytes, sets %d bytes", prefixes, keys, len(value), mapBytes, setBytes)
	if setBytes > mapBytes*7/10 {
		t.Errorf("the sets hold %d bytes, more than 70 %% of the maps' %d", setBytes, mapBytes)
	}
}

// BenchmarkWith is the fold of one changed value into a set of 100 keys,
// as each watch event of a prefix is.
func BenchmarkWith(b *testing.B) {
	m := map[string][]byte{}
	for i := range 100 {
		m[fmt.Sprintf("key-%03d", i)] = []byte("value")
	}
	s := FromMap(m)
	changes := []Change{{Key: "key-042", Value: []byte("new value")}}
	b.ReportAllocs()
	for b.Loop() {
		if _, changed := s.With(changes); !changed {
			b.Fatal("nothing changed")
		}
	}
}

// check fails t unless s holds exactly model's entries, sorted, within
// the bounds compaction keeps: at most maxChunks+1 chunks, and no more
// bytes held than twice the values' and a chunk of slack.
func check(t *testing.T, s Set, model map[string][]byte, step string) {
	t.Helper()
	checkEntries(t, s, model, step)
	if len(s.chunks) > maxChunks+1 {
		t.Fatalf("%s: %d chunks, more than %d", step, len(s.chunks), maxChunks+1)
	}
	if held, live := s.heldBytes(), s.ValueBytes(); held > 2*live+2*minChunk {
		t.Fatalf("%s: %d bytes held for %d bytes of values", step, held, live)
	}
}

// checkEntries checks that s holds model's entries, in order, in one of
// its two forms.
func checkEntries(t *testing.T, s Set, model map[string][]byte, step string) {
	t.Helper()
	if !maps.EqualFunc(s.Map(), model, bytes.Equal) || s.Len() != len(model) {
		t.Fatalf("%s: the set holds %q, want %q", step, entriesOf(s), FromMap(model).Map())
	}
	if !slices.IsSorted(slices.Collect(s.Keys())) {
		t.Fatalf("%s: the keys are not sorted", step)
	}
	for k, v := range model {
		if got, ok := s.Get(k); !ok || !bytes.Equal(got, v) {
			t.Fatalf("%s: Get(%q) = %q, %v; want %q", step, k, got, ok, v)
		}
	}
	checkForm(t, s, step)
	var live int64
	for _, v := range model {
		live += int64(len(v))
	}
	if got := s.ValueBytes(); got != live {
		t.Fatalf("%s: ValueBytes() = %d, want %d", step, got, live)
	}
}

// checkForm checks that s is in one of its two forms: refs for every
// entry, or packed — the ends of its values, in order, within its one
// chunk.
func checkForm(t *testing.T, s Set, step string) {
	t.Helper()
	switch {
	case s.Len() == 0:
	case s.refs != nil:
		if len(s.refs) != s.Len() || s.vends != nil {
			t.Fatalf("%s: %d refs and %d value ends for %d entries", step, len(s.refs), len(s.vends), s.Len())
		}
	default:
		if len(s.vends) != s.Len() || len(s.chunks) > 1 {
			t.Fatalf("%s: packed with %d value ends for %d entries in %d chunks", step, len(s.vends), s.Len(), len(s.chunks))
		}
		end := s.vstart
		for i, e := range s.vends {
			if e < end {
				t.Fatalf("%s: value %d ends at %d, before %d", step, i, e, end)
			}
			end = e
		}
		if end > s.vstart && (len(s.chunks) == 0 || int(end) > len(s.chunks[0])) {
			t.Fatalf("%s: the values end at %d, past their chunk", step, end)
		}
	}
}

// FuzzWith applies changes the fuzzer chooses, a few at a time, to a set
// and to a map, and checks after each step that they agree.
func FuzzWith(f *testing.F) {
	f.Add([]byte("\x00a1\x01b\x02c22\x00a\x03"))
	f.Add(bytes.Repeat([]byte("\x00k\xff\x01j\x00"), 40))
	f.Fuzz(func(t *testing.T, script []byte) {
		model := map[string][]byte{}
		var s Set
		var batch []Change
		for i := 0; i+1 < len(script); i += 2 {
			op, arg := script[i], script[i+1]
			key := fmt.Sprintf("k%02d", arg%37)
			switch op % 4 {
			case 0, 1: // a put
				v := bytes.Repeat([]byte{'a' + arg%26}, int(arg)%300)
				batch = append(batch, Change{Key: key, Value: v})
			case 2: // a delete
				batch = append(batch, Change{Key: key, Delete: true})
			case 3: // the batch applied; every fourth time a filter too
				next, changed := s.With(batch)
				before := FromMap(model)
				for _, c := range batch {
					if c.Delete {
						delete(model, c.Key)
					} else {
						model[c.Key] = c.Value
					}
				}
				if changed == Equal(before, FromMap(model)) {
					t.Fatalf("With reported changed %v for %d changes", changed, len(batch))
				}
				check(t, next, model, "with")
				check(t, s, before.Map(), "the set before")
				s, batch = next, nil
				// Its part under a prefix, shared, in either form.
				under := map[string][]byte{}
				for k, v := range model {
					if rel, ok := strings.CutPrefix(k, "k1"); ok {
						under[rel] = v
					}
				}
				checkEntries(t, s.Under("k1"), under, "under")
				if arg%5 == 1 {
					// Every value copied into one chunk, in key order:
					// the packed form, which the next steps start from.
					s = s.merged(func(int) bool { return true })
					if s.Len() > 0 && s.refs != nil {
						t.Fatalf("a set merged into one chunk is not packed")
					}
					check(t, s, model, "merged")
				}
				if arg%4 == 0 {
					s, _ = s.Filter(func(k string, v []byte) bool { return len(v)%3 != 0 })
					maps.DeleteFunc(model, func(k string, v []byte) bool { return len(v)%3 == 0 })
					check(t, s, model, "filter")
				}
			}
		}
	})
}

func TestWithSharesChunks(t *testing.T) {
	b := NewBuilder(1000)
	b.Grow(1000 * 100)
	for i := range 1000 {
		b.Add(fmt.Sprintf("k%04d", i), bytes.Repeat([]byte("x"), 100))
	}
	s := b.Set()
	// One value changed at a time, 1,000 times: each change copies its
	// own bytes, and compaction keeps the chunks few and the bytes held
	// within twice the values'.
	copied := int64(0)
	for i := range 1000 {
		before := s.heldBytes()
		next, changed := s.With([]Change{{Key: fmt.Sprintf("k%04d", (i*7)%1000), Value: bytes.Repeat([]byte{byte('a' + i%20)}, 100)}})
		if !changed {
			t.Fatalf("change %d changed nothing", i)
		}
		if next.keys != s.keys {
			t.Fatalf("change %d copied the keys", i)
		}
		if after := next.heldBytes(); after > before {
			copied += after - before
		}
		s = next
	}
	if len(s.chunks) > maxChunks+1 {
		t.Errorf("%d chunks after 1,000 changes", len(s.chunks))
	}
	if held := s.heldBytes(); held > 2*s.ValueBytes()+minChunk {
		t.Errorf("%d bytes held for %d of values", held, s.ValueBytes())
	}
	t.Logf("1,000 changes of 100 bytes in a set of 100,000: %d bytes held afterwards", s.heldBytes())
}

func TestUnder(t *testing.T) {
	s := FromMap(map[string][]byte{"a": []byte("0"), "app/x": []byte("1"), "app/y/z": []byte("2"), "apps": []byte("3"), "b/c": []byte("4")})
	for _, tc := range []struct {
		prefix string
		want   []string
	}{
		{"app/", []string{"x=1", "y/z=2"}},
		{"app", []string{"/x=1", "/y/z=2", "s=3"}},
		{"", []string{"a=0", "app/x=1", "app/y/z=2", "apps=3", "b/c=4"}},
		{"c/", nil},
		{"b/c", []string{"=4"}},
	} {
		got := s.Under(tc.prefix)
		if !slices.Equal(entriesOf(got), tc.want) {
			t.Errorf("Under(%q) = %q, want %q", tc.prefix, entriesOf(got), tc.want)
		}
		if got.Len() > 0 && &got.chunks[0][0] != &s.chunks[0][0] {
			t.Errorf("Under(%q) copied the values", tc.prefix)
		}
	}
}

// TestPackedForm follows a set through its two forms: packed as a read
// makes it (values in key order in one chunk), its part under a prefix
// packed and shared, refs once a change adds a chunk, packed again once
// compacted into one.
func TestPackedForm(t *testing.T) {
	b := NewBuilder(4)
	b.Grow(6)
	for _, e := range [][2]string{{"a", ""}, {"b/x", "12"}, {"b/y", ""}, {"b/z", "3456"}} {
		b.Add(e[0], []byte(e[1]))
	}
	s := b.Set()
	if s.refs != nil || len(s.vends) != 4 {
		t.Fatalf("a set read in key order into one chunk: refs %v, value ends %v; want it packed", s.refs, s.vends)
	}
	under := s.Under("b/")
	if under.refs != nil || under.vstart != 0 || !slices.Equal(entriesOf(under), []string{"x=12", "y=", "z=3456"}) {
		t.Fatalf("Under(b/) = %q (refs %v, from %d), want it packed", entriesOf(under), under.refs, under.vstart)
	}
	tail := s.Under("b/y")
	if tail.refs != nil || tail.vstart != 2 || !slices.Equal(entriesOf(tail), []string{"="}) || tail.ValueBytes() != 0 {
		t.Fatalf("Under(b/y) = %q from %d, %d bytes; want one empty value from 2", entriesOf(tail), tail.vstart, tail.ValueBytes())
	}
	if z := s.Under("b/z"); z.vstart != 2 || string(z.Value(0)) != "3456" {
		t.Fatalf("Under(b/z) = %q from %d", entriesOf(z), z.vstart)
	}
	changed, _ := s.With([]Change{{Key: "b/y", Value: []byte("new")}})
	if changed.refs == nil || !slices.Equal(entriesOf(changed), []string{"a=", "b/x=12", "b/y=new", "b/z=3456"}) {
		t.Fatalf("after a change: %q, refs %v; want refs", entriesOf(changed), changed.refs)
	}
	if again := changed.merged(func(int) bool { return true }); again.refs != nil || !Equal(again, changed) {
		t.Fatalf("compacted into one chunk: %q, refs %v; want it packed", entriesOf(again), again.refs)
	}
	// Out of order, or a key twice: the chunk's values are not in key
	// order, so the set keeps refs.
	b = NewBuilder(2)
	b.Add("b", []byte("2"))
	b.Add("a", []byte("1"))
	if s := b.Set(); s.refs == nil || !slices.Equal(entriesOf(s), []string{"a=1", "b=2"}) {
		t.Fatalf("added out of order: %q, refs %v", entriesOf(s), s.refs)
	}
}
