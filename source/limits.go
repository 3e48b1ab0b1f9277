package source

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
)

// Limits bound what a source reads and keeps for one prefix: as much as the
// mounts that follow it may take, and no more — so that what kvmount holds
// follows its configuration, not what a store's writers put there (60
// values of 1.4 MB under a mount of at most 5 files and 1 MiB once made it
// hold 300 MiB). A zero field is no bound.
type Limits struct {
	// MaxKeys is the most keys under the prefix (the populator allows
	// twice the largest max_files of the mounts that project its keys as
	// files).
	MaxKeys int
	// MaxValueSize is the largest value kept, in bytes (max_value_size):
	// a larger value is not kept; its key is in Snapshot.Oversized.
	MaxValueSize int64
	// MaxBytes is the most bytes of values kept in all (the populator
	// allows twice max_mount_size, else twice max_files × max_value_size).
	MaxBytes int64
}

// ErrOverLimits is wrapped by the error a feed reports, and a source may
// report, for a prefix that holds more keys or bytes than its Limits: the
// mounts keep their last content, stale, and the source reads the prefix
// again after a backoff.
var ErrOverLimits = errors.New("holds more than the mounts following it may take")

// Merge returns the limits that allow what l and m both allow: the larger
// of each bound, no bound where either has none.
func (l Limits) Merge(m Limits) Limits {
	larger := func(a, b int64) int64 {
		if a == 0 || b == 0 {
			return 0
		}
		return max(a, b)
	}
	return Limits{MaxKeys: int(larger(int64(l.MaxKeys), int64(m.MaxKeys))), MaxValueSize: larger(l.MaxValueSize, m.MaxValueSize), MaxBytes: larger(l.MaxBytes, m.MaxBytes)}
}

// Keeps reports whether a value of size bytes is kept under l.
func (l Limits) Keeps(size int) bool { return l.MaxValueSize == 0 || int64(size) <= l.MaxValueSize }

// Check returns an error wrapping ErrOverLimits when keys keys (oversized
// ones included) holding bytes bytes of kept values exceed l.
func (l Limits) Check(keys int, bytes int64) error {
	switch {
	case l.MaxKeys > 0 && keys > l.MaxKeys:
		return fmt.Errorf("%w: %d keys, more than its mounts may take (%d, from max_files)", ErrOverLimits, keys, l.MaxKeys)
	case l.MaxBytes > 0 && bytes > l.MaxBytes:
		return fmt.Errorf("%w: %d bytes of values, more than its mounts may take (%d, from max_mount_size or max_files × max_value_size)", ErrOverLimits, bytes, l.MaxBytes)
	}
	return nil
}

// apply returns s with every value l does not keep moved to s.Oversized
// (Entries without them, sharing its values), or an error wrapping
// ErrOverLimits.
func (l Limits) apply(s Snapshot) (Snapshot, error) {
	var dropped map[string]int64
	entries, _ := s.Entries.Filter(func(key string, value []byte) bool {
		if l.Keeps(len(value)) {
			return true
		}
		if dropped == nil {
			dropped = maps.Clone(s.Oversized)
			if dropped == nil {
				dropped = map[string]int64{}
			}
		}
		dropped[key] = int64(len(value))
		return false
	})
	s.Entries = entries
	if dropped != nil {
		s.Oversized = dropped
	}
	if err := l.Check(s.Entries.Len()+len(s.Oversized), s.Entries.ValueBytes()); err != nil {
		return Snapshot{}, err
	}
	return s, nil
}

// maxRevisionLen is the longest revision a feed keeps as its source gave
// it, in bytes (an etcd revision, a Consul index, an ETag).
const maxRevisionLen = 128

// BoundRevision returns revision as a feed keeps it: as it is when it is at
// most maxRevisionLen bytes of printable ASCII, else "sha256:" and the hex
// of its first 16 bytes of SHA-256. A revision is a server's choice (an
// HTTP ETag), and kvmount passes it on — in KVMOUNT_REVISION, whose 300 KB
// made every notify command fail with "argument list too long", in logs,
// in /status — so it must be short and plain, and stay distinct.
func BoundRevision(revision string) string {
	plain := len(revision) <= maxRevisionLen
	for i := 0; plain && i < len(revision); i++ {
		plain = revision[i] > 0x20 && revision[i] < 0x7f
	}
	if plain {
		return revision
	}
	sum := sha256.Sum256([]byte(revision))
	return "sha256:" + hex.EncodeToString(sum[:16])
}

// LimitBody returns body as one that fails, with an error wrapping
// ErrOverLimits, once it has given more than limit bytes: a source reads
// no more of a response than its mounts may take, whatever the server
// sends.
func LimitBody(body io.ReadCloser, limit int64) io.ReadCloser {
	return &limitedBody{ReadCloser: body, limit: limit, left: limit}
}

type limitedBody struct {
	io.ReadCloser
	limit, left int64
}

func (b *limitedBody) Read(p []byte) (int, error) {
	if b.left < 0 {
		return 0, b.over()
	}
	if int64(len(p)) > b.left+1 {
		p = p[:b.left+1]
	}
	n, err := b.ReadCloser.Read(p)
	b.left -= int64(n)
	if b.left < 0 {
		return n, b.over()
	}
	return n, err
}

func (b *limitedBody) over() error {
	return fmt.Errorf("a response larger than %d bytes %w", b.limit, ErrOverLimits)
}
