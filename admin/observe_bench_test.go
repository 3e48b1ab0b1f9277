package admin

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
)

// BenchmarkObservePass measures what the admin endpoint's observer (the
// /status record and the metrics) costs the reconciler's loop per pass
// over 1,000 projected mounts that did not change. Run with:
// go test -run '^$' -bench ObservePass ./admin
func BenchmarkObservePass(b *testing.B) {
	s := New(Options{Version: "bench"})
	mounts := make([]reconcile.MountStatus, 1000)
	for i := range mounts {
		mounts[i] = reconcile.MountStatus{Name: fmt.Sprintf("m%04d", i), Dir: fmt.Sprintf("/run/m%04d", i), Medium: "tmpfs", Projected: true}
	}
	b.ReportAllocs()
	for b.Loop() {
		s.Observe(reconcile.PassEvent{Mounts: mounts, Time: time.Now()})
	}
}

// BenchmarkMountSeries measures what 1,000 mounts' series cost: the heap
// that stays live once each mount was projected and notified of once
// (live-B/mount, after two collections), and a scrape of /metrics's
// registry (prometheus.Gatherer.Gather) over them, per operation. Run with:
// go test -run '^$' -bench MountSeries -benchmem ./admin
func BenchmarkMountSeries(b *testing.B) {
	const n = 1000
	live := func() uint64 {
		runtime.GC()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	s := New(Options{Version: "bench"})
	names := make([]string, n)
	mounts := make([]reconcile.MountStatus, n)
	for i := range mounts {
		names[i] = fmt.Sprintf("m%04d", i)
		mounts[i] = reconcile.MountStatus{Name: names[i], Dir: "/run/" + names[i], Medium: "tmpfs", Projected: true}
	}
	now := time.Now()
	before := live()
	for _, name := range names {
		s.Observe(reconcile.ProjectedEvent{Mount: name, Op: "setup", Version: "..v1", Change: projector.Change{Added: []string{"a"}}, Files: 100, Bytes: 7500, Time: now})
		s.NotifyResult(notify.Result{Mount: name, Kind: "command", Target: "svc", Version: "..v1", Attempt: 1, Time: now})
	}
	s.Observe(reconcile.PassEvent{Mounts: mounts, Time: now})
	perMount := float64(live()-before) / n
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.reg.Gather(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(perMount, "live-B/mount")
	runtime.KeepAlive(s)
}
