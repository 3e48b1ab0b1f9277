package projector

import (
	"fmt"
	"testing"
)

// TestDiff ports the kubelet's pathsToRemove cases: removing nested files
// lists every directory no longer needed, and keeps partial subtrees.
func TestDiff(t *testing.T) {
	f := file("x", 0o644)
	payload := func(paths ...string) Payload {
		p := Payload{}
		for _, name := range paths {
			p[name] = f
		}
		return p
	}
	tests := []struct {
		name            string
		old, new        Payload
		added, changed  []string
		removed, remDir []string
	}{
		{name: "simple", old: payload("foo.txt", "bar.txt"), new: payload("foo.txt"), removed: []string{"bar.txt"}},
		{name: "simple nested", old: payload("foo/bar.txt", "foo/baz.txt"), new: payload("foo/bar.txt"), removed: []string{"foo/baz.txt"}},
		{name: "nested, whole subtree", old: payload("foo/bar/baz.txt", "qux.txt"), new: payload("qux.txt"),
			removed: []string{"foo/bar/baz.txt"}, remDir: []string{"foo", "foo/bar"}},
		{name: "nested, partial subtree kept", old: payload("foo/bar/baz.txt", "foo/qux.txt"), new: payload("foo/qux.txt"),
			removed: []string{"foo/bar/baz.txt"}, remDir: []string{"foo/bar"}},
		{name: "deep, all but one", old: payload("a/b/c/d.txt", "a/b/e.txt", "a/f.txt", "g.txt"), new: payload("a/f.txt"),
			removed: []string{"a/b/c/d.txt", "a/b/e.txt", "g.txt"}, remDir: []string{"a/b", "a/b/c"}},
		{name: "everything", old: payload("a/b", "c"), new: payload(), removed: []string{"a/b", "c"}, remDir: []string{"a"}},
		{name: "from nothing", old: nil, new: payload("a/b", "c"), added: []string{"a/b", "c"}},
		{name: "changed mode", old: payload("a"), new: Payload{"a": file("x", 0o600)}, changed: []string{"a"}},
		{name: "changed data", old: payload("a"), new: Payload{"a": file("y", 0o644)}, changed: []string{"a"}},
		{name: "changed owner", old: payload("a"), new: Payload{"a": {Data: []byte("x"), Mode: 0o644, UID: 12345, GID: f.GID}}, changed: []string{"a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Diff(tt.old, tt.new)
			for _, check := range []struct {
				what      string
				got, want []string
			}{{"added", c.Added, tt.added}, {"changed", c.Changed, tt.changed}, {"removed", c.Removed, tt.removed}, {"removed dirs", c.RemovedDirs, tt.remDir}} {
				if fmt.Sprint(check.got) != fmt.Sprint(check.want) {
					t.Errorf("%s = %v; want %v", check.what, check.got, check.want)
				}
			}
		})
	}
}
