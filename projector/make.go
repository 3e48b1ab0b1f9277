package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strings"

	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/render"
)

// Projection is one source and prefix contributing keys to a mount, together
// with the data the source holds under the prefix.
type Projection struct {
	// Source is the source's configured name, for errors.
	Source string
	// Prefix is the key prefix; keys in Entries are relative to it.
	Prefix string
	// Items, when not nil, map chosen keys to paths; only they are projected.
	Items []Item
	// Optional makes a missing prefix or item key an empty contribution
	// rather than an error.
	Optional bool
	// Missing reports that the prefix does not exist in the source.
	Missing bool
	// Entries are the keys relative to Prefix and their values.
	Entries kvset.Set
	// Oversized maps keys whose values the source did not keep, being
	// larger than any mount following it takes, to their sizes in bytes
	// (source.Snapshot.Oversized): such a key fails the mount as a value
	// over MaxValueSize would.
	Oversized map[string]int64
	// Secrets are what templates' secret function reads of the
	// projection (source.Snapshot.Secrets); nil for most sources.
	Secrets render.Secrets
}

// Item maps one key to a path, the kubelet's KeyToPath.
type Item struct {
	// Key is relative to the projection's prefix.
	Key string
	// Path is where the value lands, relative to the mount.
	Path string
	// Mode is the file's permission; zero means the mount's default.
	Mode fs.FileMode
	// Optional makes a missing key no error.
	Optional bool
}

// Options are a mount's file settings and limits.
type Options struct {
	// Mode is the permission of files without an item mode (kubelet: 0644).
	Mode fs.FileMode
	// UID and GID own every file.
	UID, GID int
	// MaxValueSize is the largest value accepted, in bytes; 0 for no limit.
	MaxValueSize int64
	// MaxSize is the largest payload accepted, in bytes; 0 for no limit.
	MaxSize int64
	// MaxFiles is the most files a payload may hold, rendered files
	// included; 0 for no limit.
	MaxFiles int
	// Templates are rendered into the payload from the mount's keys (by
	// their paths in the mount), each limited to MaxValueSize.
	Templates []*Template
	// KeysOnlyForTemplates keeps the keys out of the payload: they feed
	// the templates only (keys_as_files = false).
	KeysOnlyForTemplates bool
	// Renders, when set, lets a template none of whose inputs changed
	// since the last call reuse its output instead of rendering again.
	Renders *RenderCache
}

// ErrPathTaken is the reason of a *KeyError for a key whose path cleans to
// the path of another key of the same projection.
var ErrPathTaken = errors.New("two keys clean to one path")

// KeyError reports a key that cannot be projected, such as one whose path
// would leave the mount. The key is skipped; the rest of the mount is
// projected.
type KeyError struct {
	Source string // source name
	Key    string // the full key: prefix + relative key
	Mount  string // mount name
	Err    error
}

// Error names the source, the key and the mount, then the reason.
func (e *KeyError) Error() string {
	return fmt.Sprintf("source %q key %q in mount %q: %v", e.Source, e.Key, e.Mount, e.Err)
}

// Unwrap returns the reason, such as an error wrapping ErrInvalidPath.
func (e *KeyError) Unwrap() error { return e.Err }

// origin is the projection and key that produced a path.
type origin struct {
	projection int
	key        string // full key
}

// originOf returns the projection and key that put path p into a payload
// MakePayload made from projections: the first that leads to p in the
// order MakePayload places them (a prefix's keys in byte order, items in
// their order). It is for error messages only, and searches: a map of
// every path's origin would be made, and dropped, for every payload.
func originOf(projections []Projection, p string) (origin, bool) {
	for i, pr := range projections {
		if pr.Missing {
			continue
		}
		if pr.Items == nil {
			// The first in byte order: the set's order.
			first, found := "", false
			for key := range pr.Entries.Keys() {
				if key == "" || strings.HasSuffix(key, "/") {
					continue
				}
				if clean, err := CleanPath(key); err == nil && clean == p {
					first, found = key, true
					break
				}
			}
			if found {
				return origin{projection: i, key: pr.Prefix + first}, true
			}
			continue
		}
		for _, it := range pr.Items {
			if !pr.Entries.Has(it.Key) {
				continue
			}
			if clean, err := CleanPath(it.Path); err == nil && clean == p {
				return origin{projection: i, key: pr.Prefix + it.Key}, true
			}
		}
	}
	return origin{}, false
}

// ErrValueTooLarge is wrapped by the error of a value, or a template's
// output, over Options.MaxValueSize (the mount's max_value_size);
// ErrMountTooLarge by that of a payload over Options.MaxSize (its
// max_mount_size). Their texts are the settings' names.
var (
	ErrValueTooLarge = errors.New("max_value_size")
	ErrMountTooLarge = errors.New("max_mount_size")
	// ErrTooManyFiles is wrapped by the error of a payload with more
	// files than Options.MaxFiles (the mount's max_files).
	ErrTooManyFiles = errors.New("max_files")
)

// MakePayload builds the payload of mount from its projections with the
// kubelet's MakePayload rules: a projection without items contributes every
// key, the key minus the prefix being the path; with items only those keys,
// at their paths and modes. Keys ending in "/" (directory markers, as Consul
// folders) and the prefix itself are skipped.
//
// A key whose path is invalid (CleanPath) or collides with another key's
// file or directory is skipped and reported as a *KeyError; of two keys of
// one projection whose paths clean to the same one ("a//b" and "a/b", "./x"
// and "x"), the later in byte order is skipped, its error naming both. The returned
// error is for what fails the whole mount, so that its last content stays:
// a missing prefix or item key that is not optional, two projections
// producing the same path, a value over opts.MaxValueSize, a payload over
// opts.MaxSize, or one with more files than opts.MaxFiles.
func MakePayload(mount string, projections []Projection, opts Options) (Payload, []*KeyError, error) {
	// Sized for every entry at once: a payload grown one entry at a time
	// leaves its smaller tables behind as garbage, between the long-lived
	// objects of other mounts (1,000 mounts set up at once).
	files := 0
	for _, pr := range projections {
		files += pr.Entries.Len()
	}
	payload := make(Payload, files)
	dirs := map[string]bool{} // directories that payload's paths need
	var rejected []*KeyError
	// What templates read: every key placed, by path, with its full key;
	// the folder markers; and the keys rejected, with why.
	var view *render.Keys
	if len(opts.Templates) > 0 {
		view = render.NewKeys()
	}
	for i, pr := range projections {
		if pr.Missing {
			if pr.Optional {
				continue
			}
			return nil, nil, fmt.Errorf("mount %q: source %q: prefix %q does not exist", mount, pr.Source, pr.Prefix)
		}
		if view != nil && pr.Secrets != nil {
			view.AddSecrets(pr.Secrets)
		}
		add := func(key, p string, mode fs.FileMode, value []byte) error {
			clean, err := CleanPath(p)
			if err == nil {
				err = placeable(payload, dirs, clean)
			}
			if err != nil {
				rejected = append(rejected, &KeyError{Source: pr.Source, Key: pr.Prefix + key, Mount: mount, Err: err})
				if view != nil {
					view.Reject(cleanOrRaw(p), err.Error())
				}
				return nil
			}
			if _, dup := payload[clean]; dup {
				by, _ := originOf(projections, clean)
				if by.projection == i && pr.Items == nil {
					err := fmt.Errorf("%w: path %q is also the path of key %q, which comes first in byte order", ErrPathTaken, clean, by.key)
					rejected = append(rejected, &KeyError{Source: pr.Source, Key: pr.Prefix + key, Mount: mount, Err: err})
					return nil
				}
				return fmt.Errorf("mount %q: path %q comes from both source %q key %q and source %q key %q", mount, clean, projections[by.projection].Source, by.key, pr.Source, pr.Prefix+key)
			}
			newDirs := 0
			for dir := path.Dir(clean); dir != "." && !dirs[dir]; dir = path.Dir(dir) {
				newDirs++
			}
			if opts.MaxFiles > 0 && len(payload)+len(dirs)+newDirs >= opts.MaxFiles+1 {
				return tooManyFiles(mount, len(payload)+1, len(dirs)+newDirs, opts.MaxFiles)
			}
			if opts.MaxValueSize > 0 && int64(len(value)) > opts.MaxValueSize {
				return fmt.Errorf("mount %q: source %q key %q: value of %d bytes exceeds %w (%d bytes)", mount, pr.Source, pr.Prefix+key, len(value), ErrValueTooLarge, opts.MaxValueSize)
			}
			if mode == 0 {
				mode = opts.Mode
			}
			payload[clean] = File{Data: value, Mode: mode.Perm(), UID: opts.UID, GID: opts.GID}
			for dir := path.Dir(clean); dir != "." && !dirs[dir]; dir = path.Dir(dir) {
				dirs[dir] = true
			}
			if view != nil {
				view.Add(clean, pr.Prefix+key, value)
			}
			return nil
		}
		if err := oversized(mount, pr, opts); err != nil {
			return nil, nil, err
		}
		if pr.Items == nil {
			// In byte order (the set's), so that of "a" and "a/b" the
			// same one always wins.
			for key, value := range pr.Entries.All() {
				switch {
				case key != "" && !strings.HasSuffix(key, "/"):
					if err := add(key, key, 0, value); err != nil {
						return nil, nil, err
					}
				case key != "" && view != nil:
					// A folder marker: no file, but keyExists "dir/".
					if clean, err := CleanPath(key); err == nil {
						view.AddFolder(clean+"/", pr.Prefix+key, value)
					}
				}
			}
			continue
		}
		for _, it := range pr.Items {
			value, ok := pr.Entries.Get(it.Key)
			if !ok {
				if it.Optional || pr.Optional {
					continue
				}
				return nil, nil, fmt.Errorf("mount %q: source %q: item references non-existent key %q", mount, pr.Source, pr.Prefix+it.Key)
			}
			if err := add(it.Key, it.Path, it.Mode, value); err != nil {
				return nil, nil, err
			}
		}
	}
	if len(opts.Templates) > 0 {
		var err error
		if payload, err = renderTemplates(mount, payload, projections, view, opts); err != nil {
			return nil, nil, err
		}
	}
	if err := CheckLimits(mount, payload, opts); err != nil {
		return nil, nil, err
	}
	return payload, rejected, nil
}

// CheckLimits applies the limits of opts that bound a whole payload:
// MaxFiles to its files and directories together, and MaxSize to its bytes
// with pageSize (4 KiB) counted for each directory, which takes a block on
// disk and a page on tmpfs. It returns an error wrapping ErrTooManyFiles or
// ErrMountTooLarge that names the mount, or nil.
func CheckLimits(mount string, payload Payload, opts Options) error {
	ndirs := len(directories(payload))
	if opts.MaxFiles > 0 && len(payload)+ndirs > opts.MaxFiles {
		return tooManyFiles(mount, len(payload), ndirs, opts.MaxFiles)
	}
	if opts.MaxSize > 0 {
		if size := payload.Size() + int64(ndirs)*pageSize; size > opts.MaxSize {
			dirsNote := ""
			if ndirs > 0 {
				dirsNote = fmt.Sprintf(" (%d bytes counted for each of its %d directories)", pageSize, ndirs)
			}
			return fmt.Errorf("mount %q: payload of %d bytes%s exceeds %w (%d bytes); the largest file is %q", mount, size, dirsNote, ErrMountTooLarge, opts.MaxSize, largest(payload))
		}
	}
	return nil
}

// oversized returns the error of the first key of pr (in byte order) whose
// value the source did not keep for its size (Projection.Oversized) and
// that pr projects: every key without items, the items' keys with.
func oversized(mount string, pr Projection, opts Options) error {
	if len(pr.Oversized) == 0 {
		return nil
	}
	var keys []string
	for key := range pr.Oversized {
		if key == "" || strings.HasSuffix(key, "/") {
			continue
		}
		if pr.Items != nil && !slices.ContainsFunc(pr.Items, func(it Item) bool { return it.Key == key }) {
			continue
		}
		keys = append(keys, key)
	}
	if len(keys) == 0 {
		return nil
	}
	slices.Sort(keys)
	return fmt.Errorf("mount %q: source %q key %q: value of %d bytes exceeds %w (%d bytes)", mount, pr.Source, pr.Prefix+keys[0], pr.Oversized[keys[0]], ErrValueTooLarge, opts.MaxValueSize)
}

// tooManyFiles is the error of a payload of files files in dirs
// directories, which together are more than maxFiles (max_files counts a
// directory as a file: on every medium a directory costs an inode, and
// deep keys would otherwise make thousands of them in a mount allowed a
// few files).
func tooManyFiles(mount string, files, dirs, maxFiles int) error {
	return fmt.Errorf("mount %q: the payload has more files and directories (%d files in %d directories) than %w (%d) allows", mount, files, dirs, ErrTooManyFiles, maxFiles)
}

// renderTemplates renders opts.Templates over the keys of view (the
// payload's, made from projections) and returns the payload with the
// rendered files —
// and without the keys when they feed the templates only. A rendered path
// that is also a key's path, or that is a file and a directory at once,
// fails the mount with an error naming both.
func renderTemplates(mount string, payload Payload, projections []Projection, view *render.Keys, opts Options) (Payload, error) {
	out := payload
	if opts.KeysOnlyForTemplates {
		out = Payload{}
	}
	dirs := directoryMap(out)
	for _, t := range opts.Templates {
		if _, ok := payload[t.Path]; ok && !opts.KeysOnlyForTemplates {
			by, _ := originOf(projections, t.Path)
			return nil, fmt.Errorf("mount %q: template %s renders %q, which is also the path of key %q", mount, t.Origin, t.Path, by.key)
		}
		if err := placeable(out, dirs, t.Path); err != nil {
			return nil, fmt.Errorf("mount %q: template %s: %w", mount, t.Origin, err)
		}
		data, err := t.render(opts.Renders, view, opts.MaxValueSize)
		if err != nil {
			return nil, fmt.Errorf("mount %q: %w", mount, err)
		}
		mode := t.Mode
		if mode == 0 {
			mode = opts.Mode
		}
		out[t.Path] = File{Data: data, Mode: mode.Perm(), UID: opts.UID, GID: opts.GID}
		for dir := path.Dir(t.Path); dir != "." && !dirs[dir]; dir = path.Dir(dir) {
			dirs[dir] = true
		}
	}
	return out, nil
}

// directoryMap returns the directories payload's paths need.
func directoryMap(payload Payload) map[string]bool {
	dirs := map[string]bool{}
	for p := range payload {
		for dir := path.Dir(p); dir != "." && !dirs[dir]; dir = path.Dir(dir) {
			dirs[dir] = true
		}
	}
	return dirs
}

// cleanOrRaw returns p cleaned when it can be, else as it is: how a
// template would name a rejected key.
func cleanOrRaw(p string) string {
	if c := path.Clean(p); c != "." {
		return c
	}
	return p
}

// largest returns the path of payload's largest file.
func largest(payload Payload) string {
	best, size := "", -1
	for _, p := range payload.Paths() {
		if n := len(payload[p].Data); n > size {
			best, size = p, n
		}
	}
	return best
}

// placeable reports whether clean can join payload, whose directories are
// dirs: it must not be one of them, nor lie below a file.
func placeable(payload Payload, dirs map[string]bool, clean string) error {
	if dirs[clean] {
		return fmt.Errorf("path %q is also a directory of other keys", clean)
	}
	for dir := path.Dir(clean); dir != "."; dir = path.Dir(dir) {
		if _, ok := payload[dir]; ok {
			return fmt.Errorf("path %q lies below file %q", clean, dir)
		}
	}
	return nil
}
