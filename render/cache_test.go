package render

import (
	"testing"
)

// TestCache: a template is rendered again only when a key it read, a
// listing it made or a folder marker it looked at changed.
func TestCache(t *testing.T) {
	tmpl, err := Parse("t", `{{ key "a" }}{{ range ls "d" }}{{ .Value }}{{ end }}{{ keyExists "f/" }}`)
	if err != nil {
		t.Fatal(err)
	}
	var cache Cache
	steps := []struct {
		keys    *Keys
		want    string
		renders int64
	}{
		{keyView("a", "1", "d/x", "2", "z", "0"), "12false", 1},
		{keyView("a", "1", "d/x", "2", "z", "changed"), "12false", 0},              // a key it never read
		{keyView("a", "9", "d/x", "2", "z", "changed"), "92false", 1},              // a key it read
		{keyView("a", "9", "d/x", "3", "z", "changed"), "93false", 1},              // a value in its listing
		{keyView("a", "9", "d/x", "3", "d/y", "4", "z", "changed"), "934false", 1}, // a key added to its listing
		{keyView("a", "9", "d/x", "3", "d/y", "4", "f/", ""), "934true", 1},        // a folder marker it looked for
		{keyView("a", "9", "d/x", "3", "d/y", "4", "f/", ""), "934true", 0},
	}
	for i, s := range steps {
		before := executions.Load()
		out, err := cache.Render(tmpl, s.keys, Limits{})
		if err != nil {
			t.Fatal(err)
		}
		if got, n := string(out), executions.Load()-before; got != s.want || n != s.renders {
			t.Errorf("step %d: %q after %d renders; want %q after %d", i, got, n, s.want, s.renders)
		}
	}
}
