package topology

import (
	"fmt"
	"strings"
	"sync"
	"testing"
)

// failures is a topology test's testing.TB: it keeps every failure the
// test reports and says them all again once the test's cleanups have
// run. Those cleanups show the logs of a failed test — kvmount's and each
// Consul, etcd or Vault node's, thousands of lines — after the failures,
// and a CI log cut to its tail showed only the logs (once a Consul
// server's log, and no failure).
type failures struct {
	testing.TB
	mu   sync.Mutex
	said []string
}

// keepFailures returns t as a failures. Call it first: its cleanup,
// registered before any other, runs after every other.
func keepFailures(t *testing.T) *failures {
	f := &failures{TB: t}
	t.Cleanup(func() {
		f.mu.Lock()
		said := f.said
		f.mu.Unlock()
		if len(said) > 0 {
			t.Logf("%d failures, said again after the logs above:\n%s", len(said), strings.Join(said, "\n"))
		}
	})
	return f
}

// keep records one failure's text.
func (f *failures) keep(text string) {
	f.mu.Lock()
	f.said = append(f.said, text)
	f.mu.Unlock()
}

// Error is testing.TB's, kept.
func (f *failures) Error(args ...any) {
	f.TB.Helper()
	f.keep(fmt.Sprint(args...))
	f.TB.Error(args...)
}

// Errorf is testing.TB's, kept.
func (f *failures) Errorf(format string, args ...any) {
	f.TB.Helper()
	f.keep(fmt.Sprintf(format, args...))
	f.TB.Errorf(format, args...)
}

// Fatal is testing.TB's, kept.
func (f *failures) Fatal(args ...any) {
	f.TB.Helper()
	f.keep(fmt.Sprint(args...))
	f.TB.Fatal(args...)
}

// Fatalf is testing.TB's, kept.
func (f *failures) Fatalf(format string, args ...any) {
	f.TB.Helper()
	f.keep(fmt.Sprintf(format, args...))
	f.TB.Fatalf(format, args...)
}
