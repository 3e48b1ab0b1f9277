// Package testlog collects the logs of a daemon or agent under test while
// the test reads them.
package testlog

import (
	"bytes"
	"strings"
	"sync"
)

// Buffer is an io.Writer that is safe for concurrent use.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

// Write appends p.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// String returns everything written.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Count returns how many lines contain every one of parts.
func (b *Buffer) Count(parts ...string) int {
	n := 0
	for line := range strings.SplitSeq(b.String(), "\n") {
		ok := line != ""
		for _, p := range parts {
			ok = ok && strings.Contains(line, p)
		}
		if ok {
			n++
		}
	}
	return n
}
