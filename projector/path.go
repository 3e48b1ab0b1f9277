// Package projector turns source data into the files of a mount: it builds
// payloads from snapshots (items, modes, optional keys) and writes them with
// the AtomicWriter, which switches a mount from one version to the next in a
// single rename, as the kubelet does for ConfigMap and Secret volumes.
package projector

import (
	"errors"
	"fmt"
	"path"
	"strings"
)

// Limits on payload paths, the kubelet's (pkg/volume/util/atomic_writer.go,
// validatePath).
const (
	// MaxPathLength is the longest payload path, in bytes.
	MaxPathLength = 4096
	// MaxNameLength is the longest path element, in bytes.
	MaxNameLength = 255
)

// ErrInvalidPath is wrapped by every error of CleanPath.
var ErrInvalidPath = errors.New("invalid path")

// CleanPath validates p with the kubelet's rules and returns it cleaned
// ("foo//bar/" becomes "foo/bar").
//
// A path must not be empty, must be relative, must not hold a ".." element,
// must not exceed MaxPathLength bytes nor hold an element longer than
// MaxNameLength bytes, and its first element must not start with ".." (names
// such as "..data" are the atomic writer's own). kvmount also rejects NUL
// bytes, and applies the ".." prefix rule to the cleaned path too, so that
// "./..data" cannot reach the reserved names. Errors wrap ErrInvalidPath.
func CleanPath(p string) (string, error) {
	if err := validateRaw(p); err != nil {
		return "", err
	}
	clean := path.Clean(p)
	if clean == "." {
		return "", fmt.Errorf("%w %q: must name a file, not the mount itself", ErrInvalidPath, p)
	}
	if strings.HasPrefix(clean, "..") {
		return "", fmt.Errorf("%w %q: must not start with '..'", ErrInvalidPath, p)
	}
	return clean, nil
}

// validateRaw applies the kubelet's checks to the path as given, before
// cleaning, so that "hello/../etc" is rejected rather than cleaned to "etc".
func validateRaw(p string) error {
	switch {
	case p == "":
		return fmt.Errorf("%w: must not be empty", ErrInvalidPath)
	case len(p) > MaxPathLength:
		return fmt.Errorf("%w %.40q...: must be at most %d bytes", ErrInvalidPath, p, MaxPathLength)
	case strings.IndexByte(p, 0) >= 0:
		return fmt.Errorf("%w %q: must not contain a NUL byte", ErrInvalidPath, p)
	case path.IsAbs(p):
		return fmt.Errorf("%w %q: must be a relative path", ErrInvalidPath, p)
	case strings.HasPrefix(p, ".."):
		return fmt.Errorf("%w %q: must not start with '..'", ErrInvalidPath, p)
	}
	for elem := range strings.SplitSeq(p, "/") {
		if elem == ".." {
			return fmt.Errorf("%w %q: must not contain '..'", ErrInvalidPath, p)
		}
		if len(elem) > MaxNameLength {
			return fmt.Errorf("%w %q: elements must be at most %d bytes", ErrInvalidPath, p, MaxNameLength)
		}
	}
	return nil
}
