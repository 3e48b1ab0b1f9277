package admin

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"

	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
)

// TestMountSeriesEncodings: the series mountCollector writes straight
// into the registry's objects, their label pairs shared within a scrape,
// are each written with their labels in the order of their names, and
// say the same in the text format and in the protobuf format Prometheus
// asks for first, under scrapes at once (the race detector watches the
// shared pairs).
func TestMountSeriesEncodings(t *testing.T) {
	s := New(Options{Version: "test"})
	now := time.Date(2026, 11, 22, 1, 2, 3, 0, time.UTC)
	var mounts []reconcile.MountStatus
	for i, m := range []string{"b", "a", "c-x_y"} {
		s.Observe(reconcile.ProjectedEvent{Mount: m, Op: "setup", Version: "..v1", Change: projector.Change{Added: []string{"k"}}, Files: 3 + i, Bytes: 50, Time: now})
		s.NotifyResult(notify.Result{Mount: m, Kind: "command", Target: "svc", Version: "..v1", Attempt: 1, Time: now})
		if i > 0 {
			s.NotifyResult(notify.Result{Mount: m, Kind: "webhook", Err: errors.New("502"), Time: now})
			s.Observe(reconcile.HeldBackEvent{Mount: m, Guard: "min_keys", Time: now})
			s.Observe(reconcile.FailedEvent{Mount: m, Op: "remount", Guard: "check_command", Err: errors.New("refused"), Time: now})
		}
		mounts = append(mounts, reconcile.MountStatus{Name: m, Dir: "/run/" + m, Medium: "tmpfs", Projected: i != 0})
	}
	s.Observe(reconcile.PassEvent{Time: now, Mounts: mounts})
	s.Observe(reconcile.FailedEvent{Mount: "gone", Op: "teardown", Guard: "mount_dir_unrecognized", Err: errors.New("unrecognized"), Time: now})

	// The collector's own output, before the registry (which sorts a
	// copy of pairs out of order): each series' pairs in the order of
	// their names, as prometheus.Metric's Write asks.
	ch := make(chan prometheus.Metric, 100)
	newMountCollector(s).Collect(ch)
	close(ch)
	for m := range ch {
		var out dto.Metric
		if err := m.Write(&out); err != nil {
			t.Fatal(err)
		}
		for i := 1; i < len(out.GetLabel()); i++ {
			if out.Label[i-1].GetName() >= out.Label[i].GetName() {
				t.Errorf("%s: labels %v not in the order of their names", m.Desc(), out.GetLabel())
			}
		}
	}

	h := s.Handler()
	scrape := func(accept string) string {
		req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
		if accept != "" {
			req.Header.Set("Accept", accept)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		body, _ := io.ReadAll(rec.Body)
		return string(body)
	}
	// mountFamilies keeps the families of each mount's series.
	mountFamilies := func(families []*dto.MetricFamily) string {
		// The text decoder gives the families in no order.
		slices.SortFunc(families, func(a, b *dto.MetricFamily) int { return strings.Compare(a.GetName(), b.GetName()) })
		var b strings.Builder
		for _, mf := range families {
			name := mf.GetName()
			if !strings.HasPrefix(name, "kvmount_mount_") && name != "kvmount_projections_total" &&
				name != "kvmount_guard_rejections_total" && name != "kvmount_notify_total" {
				continue
			}
			if _, err := expfmt.MetricFamilyToText(&b, mf); err != nil {
				t.Fatal(err)
			}
		}
		return b.String()
	}
	decode := func(body string, format expfmt.Format) string {
		dec := expfmt.NewDecoder(strings.NewReader(body), format)
		var families []*dto.MetricFamily
		for {
			mf := &dto.MetricFamily{}
			if err := dec.Decode(mf); err == io.EOF {
				break
			} else if err != nil {
				t.Fatalf("decoding %s: %v", format, err)
			}
			families = append(families, mf)
		}
		return mountFamilies(families)
	}
	protobuf := expfmt.NewFormat(expfmt.TypeProtoDelim)
	var wg sync.WaitGroup
	bodies := make([]string, 4)
	for i := range bodies {
		wg.Go(func() {
			if i%2 == 0 {
				bodies[i] = scrape(string(protobuf))
			} else {
				bodies[i] = scrape("")
			}
		})
	}
	wg.Wait()
	text := decode(bodies[1], expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, want := range []string{
		`kvmount_projections_total{mount="a",result="held_back"} 1`,
		`kvmount_guard_rejections_total{guard="check_command",mount="c-x_y"} 1`,
		`kvmount_guard_rejections_total{guard="mount_dir_unrecognized",mount="gone"} 1`,
		`kvmount_notify_total{kind="webhook",mount="a",result="failure"} 1`,
		`kvmount_mount_projected{mount="b"} 0`,
		`kvmount_mount_files{mount="c-x_y"} 5`,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("the text scrape lacks %s:\n%s", want, text)
		}
	}
	for i, body := range bodies {
		got := ""
		if i%2 == 0 {
			got = decode(body, protobuf)
		} else {
			got = decode(body, expfmt.NewFormat(expfmt.TypeTextPlain))
		}
		if got != text {
			t.Errorf("scrape %d says otherwise than the text scrape:\n%s\nwant:\n%s", i, got, text)
		}
	}
}
