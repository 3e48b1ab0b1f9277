package admin

import (
	"fmt"
	"testing"
	"time"

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
