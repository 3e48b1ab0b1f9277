package render

import (
	"fmt"
	"maps"
	"slices"
)

// Scratch is a render's scratchpad, consul-template's scratch: values a
// template stores and reads back within one render; nothing is kept
// between renders. It holds at most maxScratch entries (keys and the keys
// of its maps together).
type Scratch struct {
	values  map[string]any
	entries int
}

// maxScratch bounds a render's scratchpad, in entries.
const maxScratch = 1 << 16

var errScratchFull = fmt.Errorf("scratch: more than %d entries", maxScratch)

// Key reports whether k holds a value, even nil.
func (s *Scratch) Key(k string) bool {
	_, ok := s.values[k]
	return ok
}

// Get returns the value at k, or nil.
func (s *Scratch) Get(k string) any { return s.values[k] }

// Set stores v at k, replacing what was there; it returns "".
func (s *Scratch) Set(k string, v any) (string, error) { return s.set(k, v, true) }

// SetX stores v at k unless k holds a value; it returns "".
func (s *Scratch) SetX(k string, v any) (string, error) { return s.set(k, v, false) }

func (s *Scratch) set(k string, v any, override bool) (string, error) {
	if s.values == nil {
		s.values = map[string]any{}
	}
	if _, ok := s.values[k]; ok && !override {
		return "", nil
	} else if !ok {
		if s.entries++; s.entries > maxScratch {
			return "", errScratchFull
		}
	}
	s.values[k] = v
	return "", nil
}

// MapSet stores v at mk in the map named k, replacing what was there; it
// returns "".
func (s *Scratch) MapSet(k, mk string, v any) (string, error) { return s.mapSet(k, mk, v, true) }

// MapSetX stores v at mk in the map named k unless mk holds a value; it
// returns "".
func (s *Scratch) MapSetX(k, mk string, v any) (string, error) { return s.mapSet(k, mk, v, false) }

func (s *Scratch) mapSet(k, mk string, v any, override bool) (string, error) {
	if _, ok := s.values[k]; !ok {
		if _, err := s.set(k, map[string]any{}, true); err != nil {
			return "", err
		}
	}
	m, ok := s.values[k].(map[string]any)
	if !ok {
		return "", fmt.Errorf("%q is not a map", k)
	}
	if _, ok := m[mk]; ok && !override {
		return "", nil
	} else if !ok {
		if s.entries++; s.entries > maxScratch {
			return "", errScratchFull
		}
	}
	m[mk] = v
	return "", nil
}

// MapValues returns the values of the map named k, sorted by their keys;
// nil when k holds no map.
func (s *Scratch) MapValues(k string) ([]any, error) {
	m, ok := s.values[k].(map[string]any)
	if !ok {
		return nil, nil
	}
	var out []any
	for _, mk := range slices.Sorted(maps.Keys(m)) {
		out = append(out, m[mk])
	}
	return out, nil
}
