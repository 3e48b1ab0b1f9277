package projector

import (
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/kvset"
)

func TestMakePayload(t *testing.T) {
	defaults := Options{Mode: 0o644, UID: 7, GID: 8}
	f := func(data string, mode uint32) File {
		return File{Data: []byte(data), Mode: fs.FileMode(mode), UID: 7, GID: 8}
	}
	entries := kvset.FromMap(map[string][]byte{"a": []byte("A"), "dir/b": []byte("B"), "dir/": nil, "": []byte("self")})
	tests := []struct {
		name         string
		projections  []Projection
		want         Payload
		wantRejected []string // keys
		wantErr      string
		maxValue     int64
		maxSize      int64
	}{
		{
			name:        "value within max_value_size",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1234")})}},
			maxValue:    4,
			want:        Payload{"a": f("1234", 0o644)},
		},
		{
			name:        "value over max_value_size",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1"), "big": []byte("12345")})}},
			maxValue:    4,
			wantErr:     `mount "m": source "s" key "/p/big": value of 5 bytes exceeds max_value_size (4 bytes)`,
		},
		{
			name:        "payload over max_mount_size",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("123"), "b": []byte("12345")})}},
			maxSize:     7,
			wantErr:     `mount "m": payload of 8 bytes exceeds max_mount_size (7 bytes); the largest file is "b"`,
		},
		{
			name:        "every key, markers skipped",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: entries}},
			want:        Payload{"a": f("A", 0o644), "dir/b": f("B", 0o644)},
		},
		{
			name: "items choose keys, paths and modes",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: entries, Items: []Item{
				{Key: "a", Path: "conf/a.conf", Mode: 0o400},
				{Key: "dir/b", Path: "b"},
			}}},
			want: Payload{"conf/a.conf": f("A", 0o400), "b": f("B", 0o644)},
		},
		{
			name:        "missing prefix",
			projections: []Projection{{Source: "s", Prefix: "/p/", Missing: true}},
			wantErr:     `prefix "/p/" does not exist`,
		},
		{
			name:        "missing optional prefix",
			projections: []Projection{{Source: "s", Prefix: "/p/", Missing: true, Optional: true}},
			want:        Payload{},
		},
		{
			name:        "missing item",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: entries, Items: []Item{{Key: "nope", Path: "x"}}}},
			wantErr:     `non-existent key "/p/nope"`,
		},
		{
			name:        "missing optional item",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: entries, Items: []Item{{Key: "nope", Path: "x", Optional: true}, {Key: "a", Path: "a"}}}},
			want:        Payload{"a": f("A", 0o644)},
		},
		{
			name:        "missing item in optional projection",
			projections: []Projection{{Source: "s", Prefix: "/p/", Optional: true, Entries: entries, Items: []Item{{Key: "nope", Path: "x"}}}},
			want:        Payload{},
		},
		{
			name: "bad keys are rejected, the rest projected",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{
				"../escape": []byte("x"), "ok": []byte("ok"), "..data": []byte("x"), "a\x00b": []byte("x"), "sub/../../up": []byte("x"),
			})}},
			want:         Payload{"ok": f("ok", 0o644)},
			wantRejected: []string{"/p/../escape", "/p/..data", "/p/a\x00b", "/p/sub/../../up"},
		},
		{
			name:         "file and directory of the same name",
			projections:  []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1"), "a/b": []byte("2")})}},
			want:         Payload{"a": f("1", 0o644)},
			wantRejected: []string{"/p/a/b"},
		},
		{
			name: "two projections",
			projections: []Projection{
				{Source: "one", Prefix: "/x/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1")})},
				{Source: "two", Prefix: "y/", Entries: kvset.FromMap(map[string][]byte{"b": []byte("2")})},
			},
			want: Payload{"a": f("1", 0o644), "b": f("2", 0o644)},
		},
		{
			name: "two projections, same path",
			projections: []Projection{
				{Source: "one", Prefix: "/x/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1")})},
				{Source: "two", Prefix: "y/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("2")})},
			},
			wantErr: `path "a" comes from both source "one" key "/x/a" and source "two" key "y/a"`,
		},
		{
			name: "keys that clean to one path: the later in byte order is rejected",
			projections: []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{
				"a//b": []byte("1"), "a/b": []byte("2"), "./x": []byte("3"), "x": []byte("4"), "d/.": []byte("5"), "d": []byte("6"), "ok": []byte("7"),
			})}},
			want:         Payload{"a/b": f("1", 0o644), "x": f("3", 0o644), "d": f("6", 0o644), "ok": f("7", 0o644)},
			wantRejected: []string{"/p/a/b", "/p/d/.", "/p/x"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := defaults
			opts.MaxValueSize, opts.MaxSize = tt.maxValue, tt.maxSize
			got, rejected, err := MakePayload("m", tt.projections, opts)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("MakePayload error = %v; want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !got.Equal(tt.want) {
				t.Errorf("payload %v; want %v", describe(got), describe(tt.want))
			}
			var keys []string
			for _, r := range rejected {
				keys = append(keys, r.Key)
				if r.Mount != "m" || r.Source != "s" || !strings.Contains(r.Error(), `mount "m"`) {
					t.Errorf("rejection %v does not name source and mount", r)
				}
				if !errors.Is(r, ErrInvalidPath) && !errors.Is(r, ErrPathTaken) && !strings.Contains(r.Error(), "directory") && !strings.Contains(r.Error(), "below") {
					t.Errorf("rejection %v has no reason", r)
				}
			}
			if strings.Join(keys, ",") != strings.Join(tt.wantRejected, ",") {
				t.Errorf("rejected %q; want %q", keys, tt.wantRejected)
			}
		})
	}
}

// FuzzMakePayload maps fuzzed keys to paths: every path in a payload is
// clean, local to the mount and not reserved, and every key is either
// projected or rejected with a reason.
func FuzzMakePayload(f *testing.F) {
	for _, seed := range [][3]string{{"a", "b/c", ""}, {"../x", "y", ""}, {"a", "a/b", ""}, {"..data", "./..data_tmp", ""}, {"k", "v", "p/"}, {"/abs", "a//b/", ""}, {"a\x00", "ok", ""}} {
		f.Add(seed[0], seed[1], seed[2])
	}
	f.Fuzz(func(t *testing.T, k1, k2, item string) {
		pr := Projection{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{k1: []byte("1"), k2: []byte("2")})}
		if item != "" {
			pr.Items = []Item{{Key: k1, Path: item}, {Key: k2, Path: k2, Optional: true}}
		}
		payload, rejected, err := MakePayload("m", []Projection{pr}, Options{Mode: 0o644})
		if err != nil {
			return
		}
		for p := range payload {
			clean, cerr := CleanPath(p)
			if cerr != nil || clean != p || !filepath.IsLocal(p) || strings.HasPrefix(p, "..") {
				t.Fatalf("keys %q, %q (item %q) gave path %q", k1, k2, item, p)
			}
		}
		for _, r := range rejected {
			if r.Err == nil || r.Mount != "m" || r.Source != "s" {
				t.Fatalf("rejection without a reason or a name: %+v", r)
			}
		}
		if item == "" {
			// Every key is projected or rejected, none lost.
			eligible := 0
			for k := range pr.Entries.All() {
				if k != "" && !strings.HasSuffix(k, "/") {
					eligible++
				}
			}
			if len(payload)+len(rejected) != eligible {
				t.Fatalf("keys %q, %q: %d projected + %d rejected; want %d", k1, k2, len(payload), len(rejected), eligible)
			}
		}
	})
}

// TestPathTakenNamesTheKeyPlaced: a key whose path an earlier key (in byte
// order) took is rejected with an error that names that earlier key.
func TestPathTakenNamesTheKeyPlaced(t *testing.T) {
	pr := []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{
		"a//b": []byte("1"), "a/b": []byte("2"), "./x": []byte("3"), "x": []byte("4"), "x//": []byte("5"),
	})}}
	_, rejected, err := MakePayload("m", pr, Options{Mode: 0o644})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"/p/a/b": `key "/p/a//b"`, "/p/x": `key "/p/./x"`}
	for _, r := range rejected {
		if !errors.Is(r, ErrPathTaken) || !strings.Contains(r.Error(), want[r.Key]) {
			t.Errorf("rejection of %s: %v; want ErrPathTaken naming %s", r.Key, r, want[r.Key])
		}
		delete(want, r.Key)
	}
	if len(want) > 0 {
		t.Errorf("not rejected: %v", want)
	}
}

// TestDirectoriesCountAgainstTheLimits is the second review's eighth
// finding: two keys 1,000 levels deep made 2,005 directories in a mount
// allowed 5 files. A directory counts as a file against max_files and as
// a page against max_mount_size, on every medium, so that such a payload
// is refused before anything is written.
func TestDirectoriesCountAgainstTheLimits(t *testing.T) {
	deep := func(leaf string) string { return strings.Repeat("d/", 1000) + leaf }
	projections := []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{deep("a"): []byte("1"), deep("b"): []byte("2")})}}
	opts := Options{Mode: 0o644, UID: -1, GID: -1, MaxFiles: 5}
	if _, _, err := MakePayload("m", projections, opts); !errors.Is(err, ErrTooManyFiles) || !strings.Contains(err.Error(), "1000 directories") {
		t.Errorf("deep keys under max_files = 5: %v; want ErrTooManyFiles", err)
	}
	opts = Options{Mode: 0o644, UID: -1, GID: -1, MaxSize: 64 << 10}
	if _, _, err := MakePayload("m", projections, opts); !errors.Is(err, ErrMountTooLarge) || !strings.Contains(err.Error(), "1000 directories") {
		t.Errorf("deep keys under max_mount_size = 64 KiB: %v; want ErrMountTooLarge counting the directories", err)
	}
	// Within the limits: one file in two directories is three entries.
	small := []Projection{{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"x/y/z": []byte("1")})}}
	if _, _, err := MakePayload("m", small, Options{Mode: 0o644, UID: -1, GID: -1, MaxFiles: 3}); err != nil {
		t.Errorf("one file in two directories under max_files = 3: %v", err)
	}
	if _, _, err := MakePayload("m", small, Options{Mode: 0o644, UID: -1, GID: -1, MaxFiles: 2}); !errors.Is(err, ErrTooManyFiles) {
		t.Errorf("one file in two directories under max_files = 2: %v; want ErrTooManyFiles", err)
	}
}

// TestOversizedKeysFailTheMount: a key whose value the source did not keep
// for its size (Projection.Oversized) fails the mount as a value over
// max_value_size does, naming key and size — unless items leave it out.
func TestOversizedKeysFailTheMount(t *testing.T) {
	pr := Projection{Source: "s", Prefix: "/p/", Entries: kvset.FromMap(map[string][]byte{"a": []byte("1")}), Oversized: map[string]int64{"big": 1_400_000}}
	opts := Options{Mode: 0o644, UID: -1, GID: -1, MaxValueSize: 1 << 20}
	if _, _, err := MakePayload("m", []Projection{pr}, opts); !errors.Is(err, ErrValueTooLarge) || !strings.Contains(err.Error(), `key "/p/big": value of 1400000 bytes`) {
		t.Errorf("an oversized key: %v; want ErrValueTooLarge naming it", err)
	}
	pr.Items = []Item{{Key: "a", Path: "a"}}
	if got, _, err := MakePayload("m", []Projection{pr}, opts); err != nil || len(got) != 1 {
		t.Errorf("items without the oversized key: %v, %v; want a alone", got, err)
	}
}
