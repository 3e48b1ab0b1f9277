package config

import (
	"bytes"
	"fmt"

	"github.com/BurntSushi/toml"
)

// Excerpt returns the configuration text data (a file that Parse accepts)
// with only the [sources.NAME] tables of sources and the [[mount]] tables
// of mounts (by their name), every top-level setting kept: what one
// worker is given, so that it never holds the text — URLs, file names —
// of the sources and mounts of another trust domain. The text is
// encoded anew (TOML, as BurntSushi/toml writes it): its lines are not
// those of data, and its comments are gone. It returns an error for a
// text that is not TOML.
func Excerpt(data []byte, sources, mounts []string) ([]byte, error) {
	var raw map[string]any
	if _, err := toml.Decode(string(data), &raw); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	keepSource, keepMount := set(sources), set(mounts)
	if tables, ok := raw["sources"].(map[string]any); ok {
		kept := map[string]any{}
		for name, t := range tables {
			if keepSource[name] {
				kept[name] = t
			}
		}
		raw["sources"] = kept
	}
	if tables, ok := raw["mount"].([]map[string]any); ok {
		var kept []map[string]any
		for _, t := range tables {
			if name, _ := t["name"].(string); keepMount[name] {
				kept = append(kept, t)
			}
		}
		if kept == nil {
			delete(raw, "mount")
		} else {
			raw["mount"] = kept
		}
	}
	var out bytes.Buffer
	if err := toml.NewEncoder(&out).Encode(raw); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return out.Bytes(), nil
}

// set returns names as a set.
func set(names []string) map[string]bool {
	out := make(map[string]bool, len(names))
	for _, name := range names {
		out[name] = true
	}
	return out
}
