package projector

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

func TestCleanPath(t *testing.T) {
	tests := []struct {
		name    string
		path    string
		want    string
		wantErr string
	}{
		{name: "valid nested", path: "i/am/well/behaved.txt", want: "i/am/well/behaved.txt"},
		{name: "dotfile", path: ".hidden", want: ".hidden"},
		{name: "nested dot-dot prefix is allowed", path: "foo/..bar", want: "foo/..bar"},
		{name: "double slash cleaned", path: "foo//bar", want: "foo/bar"},
		{name: "many slashes cleaned", path: "foo////bar/baz", want: "foo/bar/baz"},
		{name: "trailing slash cleaned", path: "foo/", want: "foo"},
		{name: "dot element cleaned", path: "./foo/./bar", want: "foo/bar"},
		{name: "spaces and unicode", path: "with space/ünïcödé.txt", want: "with space/ünïcödé.txt"},
		{name: "max name length", path: strings.Repeat("a", MaxNameLength), want: strings.Repeat("a", MaxNameLength)},
		{name: "empty", path: "", wantErr: "must not be empty"},
		{name: "absolute", path: "/dev/null", wantErr: "must be a relative path"},
		{name: "too long path", path: strings.Repeat("a/", MaxPathLength/2) + "a", wantErr: "at most 4096 bytes"},
		{name: "too long name", path: "dir/" + strings.Repeat("a", MaxNameLength+1), wantErr: "at most 255 bytes"},
		{name: "sneaky dot-dot prefix", path: "..sneaky.txt", wantErr: "must not start with '..'"},
		{name: "reserved data dir", path: "..data", wantErr: "must not start with '..'"},
		{name: "reserved after cleaning", path: "./..data/x", wantErr: "must not start with '..'"},
		{name: "dot-dot element", path: "hello/../etc", wantErr: "must not contain '..'"},
		{name: "trailing dot-dot", path: "hello/..", wantErr: "must not contain '..'"},
		{name: "only dot-dot", path: "..", wantErr: "must not start with '..'"},
		{name: "NUL byte", path: "a\x00b", wantErr: "NUL"},
		{name: "mount itself", path: ".", wantErr: "must name a file"},
		{name: "mount itself with slash", path: "./", wantErr: "must name a file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := CleanPath(tt.path)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("CleanPath(%q) = %q, %v; want error containing %q", tt.path, got, err, tt.wantErr)
				}
				if !errors.Is(err, ErrInvalidPath) {
					t.Errorf("error %v does not wrap ErrInvalidPath", err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("CleanPath(%q) = %q, %v; want %q", tt.path, got, err, tt.want)
			}
		})
	}
}

// FuzzCleanPath proves that no key produces a path that leaves the mount or
// reaches the atomic writer's reserved names.
func FuzzCleanPath(f *testing.F) {
	for _, seed := range []string{"a", "a/b", "../x", "/etc/passwd", "a/../../b", "..data", "./..data", "a\x00", "a//b/", ".", "...", "a/..b"} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, p string) {
		clean, err := CleanPath(p)
		if err != nil {
			return
		}
		if !filepath.IsLocal(clean) {
			t.Fatalf("CleanPath(%q) = %q, which is not local to the mount", p, clean)
		}
		if strings.HasPrefix(clean, "..") || clean == "." || strings.ContainsRune(clean, 0) {
			t.Fatalf("CleanPath(%q) = %q, a reserved or empty name", p, clean)
		}
		if again, err := CleanPath(clean); err != nil || again != clean {
			t.Fatalf("CleanPath(%q) = %q, %v; want it unchanged", clean, again, err)
		}
	})
}
