package privsep

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

// BenchmarkRemoteResend is the monitor's heap for the desired payloads of
// 1,000 mounts of 100 keys of 80 bytes (the sizes of
// BenchmarkScale100kKeys), once the worker has sent them all (first-MiB)
// and once a worker started again has sent them all again, equal
// (resent-MiB): the live heap after a collection, of the Remote and the
// desired state it populates.
func BenchmarkRemoteResend(b *testing.B) {
	const mounts, keys = 1000, 100
	var first, resent float64
	for range b.N {
		r, specs := benchRemote(b, mounts)
		sendAll := func() {
			for _, m := range specs {
				files := make(projector.Payload, keys)
				for k := range keys {
					files[fmt.Sprintf("key-%03d", k)] = projector.File{Data: fmt.Appendf(make([]byte, 0, 80), "%080d", k), Mode: 0o644}
				}
				r.HandleMessage("main", &MountState{Mount: m.Name, Generation: 1, Revision: "main@1"})
				r.HandlePayload("main", &Payload{Mount: m.Name, Revision: "main@1", Files: files})
			}
			r.Populate()
		}
		base := liveHeap()
		sendAll()
		first += float64(liveHeap()-base) / (1 << 20)
		sendAll()
		resent += float64(liveHeap()-base) / (1 << 20)
		runtime.KeepAlive(r)
	}
	b.ReportMetric(first/float64(b.N), "first-MiB")
	b.ReportMetric(resent/float64(b.N), "resent-MiB")
}

// liveHeap returns the bytes of live heap objects after a collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// BenchmarkRemotePopulate measures the Populate of a reconciler's pass
// over 1,000 mounts of which one changed since the last: a new report of
// its state (a pass follows every few results during a restart). Run
// with: go test -run '^$' -bench RemotePopulate ./privsep
func BenchmarkRemotePopulate(b *testing.B) {
	const mounts = 1000
	r, specs := benchRemote(b, mounts)
	for _, m := range specs {
		r.HandleMessage("main", &MountState{Mount: m.Name, Generation: 1, Revision: "main@1"})
	}
	r.Populate()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		m := specs[i%mounts]
		i++
		r.HandleMessage("main", &MountState{Mount: m.Name, Generation: 1, Revision: "main@1"})
		if d := r.Populate()[m.Name]; d == nil {
			b.Fatalf("no desired state of %s", m.Name)
		}
	}
}

// benchRemote returns a Remote configured with n mounts of source "main"
// (m0000, m0001, ...), and their configurations.
func benchRemote(b *testing.B, n int) (*Remote, []*config.Mount) {
	b.Helper()
	r := NewRemote()
	var specs []*config.Mount
	for i := range n {
		specs = append(specs, &config.Mount{Name: fmt.Sprintf("m%04d", i), UID: -1, GID: -1, Projections: []config.Projection{{Source: "main"}}})
	}
	if err := r.SetMounts(specs); err != nil {
		b.Fatal(err)
	}
	return r, specs
}
