package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// BenchmarkPutToFileBeside999Mounts is BenchmarkPutToFile's etcd/tmpfs
// case in a daemon that projects 999 other mounts (one key each, on
// disk, at rest) beside the one updated: what an update costs a daemon
// of 1,000 mounts, where the reconciler's passes and the worker's
// publication used to visit every mount on each update. The floor runs
// beside it, and $KVMOUNT_BENCH_BASELINE, when set, as "baseline" with the
// same 999 mounts. Run with: go test -run '^$' -bench
// PutToFileBeside999Mounts -benchtime 1000x ./daemon
func BenchmarkPutToFileBeside999Mounts(b *testing.B) {
	const idle = 999
	baseline := os.Getenv("KVMOUNT_BENCH_BASELINE")
	store := etcdStore(b)
	names := []string{"floor", "head"}
	if baseline != "" {
		names = []string{"floor", "baseline", "head"}
	}
	sides := make([]updateSide, len(names))
	for i, name := range names {
		sides[i].name = name
		sides[i].store = store
		sides[i].store.prefix = fmt.Sprintf("%s%s/", store.prefix, name)
		if name == "floor" {
			sides[i].dir = startFloor(b, sides[i].store, store.endpoint, "tmpfs", "one")
			continue
		}
		mounts, last := idleMounts(b, store, name, idle)
		bin := ""
		if name == "baseline" {
			bin = baseline
		}
		sides[i].dir = benchDaemonWith(b, sides[i].store, 1, "tmpfs", benchExtras{bin: bin, mount: mounts})
		waitForFile(b, last)
	}
	measureSideBySide(b, sides)
}

// idleMounts seeds n keys below the store's prefix under side's name and
// returns the [[mount]] tables projecting each into a disk mount of its
// own, to append to a daemon's configuration, and the path of the last
// mount's file.
func idleMounts(b *testing.B, store benchStore, side string, n int) (tables, last string) {
	b.Helper()
	base := b.TempDir()
	var kv []string
	var t strings.Builder
	for i := range n {
		prefix := fmt.Sprintf("%sidle-%s/%04d/", store.prefix, side, i)
		kv = append(kv, prefix+"key", fmt.Sprintf("value %d", i))
		dir := filepath.Join(base, fmt.Sprintf("m%04d", i))
		fmt.Fprintf(&t, "\n[[mount]]\nname = \"idle-%04d\"\ndir = %q\nsource = \"main\"\nprefix = %q\n", i, dir, prefix)
		last = filepath.Join(dir, "key")
	}
	for i := 0; i < len(kv); i += 256 {
		store.seed(kv[i:min(i+256, len(kv))])
	}
	return t.String(), last
}

// waitForFile waits until path exists: the last of a daemon's mounts
// projected.
func waitForFile(b *testing.B, path string) {
	b.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s never appeared", path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
