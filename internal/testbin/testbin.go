// Package testbin finds the server and tool binaries that kvmount's tests
// run and that scripts/ build once from the Go module proxy and cache in
// ${XDG_CACHE_HOME:-~/.cache}/kvmount/.
package testbin

import (
	"os"
	"path/filepath"
	"testing"
)

// Binary describes one cached build.
type Binary struct {
	// What names it in messages ("Vault server").
	What string
	// Env is the variable that names a binary to use instead
	// ("KVMOUNT_VAULT").
	Env string
	// Dir and Name are its directory in the cache and its file name
	// ("vault-v1.16.3", "vault").
	Dir, Name string
	// Script is the script that builds it ("scripts/vault-server.sh").
	Script string
}

// Find returns the binary: $Env, else the cached build. When there is
// none the test is skipped — or fails when CI=true, where a missing
// dependency must never pass unnoticed.
func (b Binary) Find(tb testing.TB) string {
	tb.Helper()
	if bin := os.Getenv(b.Env); bin != "" {
		return bin
	}
	if bin := b.Cached(); bin != "" {
		return bin
	}
	if os.Getenv("CI") == "true" {
		tb.Fatalf("no %s: run %s (make test does) or set %s", b.What, b.Script, b.Env)
	}
	tb.Skipf("no %s: run %s or set %s", b.What, b.Script, b.Env)
	return ""
}

// Cached returns the path of the cached build, "" when there is none.
func (b Binary) Cached() string {
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache")
	}
	bin := filepath.Join(cache, "kvmount", b.Dir, b.Name)
	if _, err := os.Stat(bin); err != nil {
		return ""
	}
	return bin
}
