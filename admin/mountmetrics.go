package admin

import (
	"maps"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvmount/kvmount/reconcile"
)

// Each mount's series: counted beside its status, made at a scrape.

// Projection results, the result label of kvmount_projections_total.
const (
	resultChanged = iota
	resultUnchanged
	resultFailed
	resultHeldBack
	numResults
)

var resultNames = [numResults]string{"changed", "unchanged", "failed", "held_back"}

// mountCounts are a mount's counters, kept by the Server beside its status
// (Server.counts) and exported by mountCollector.
type mountCounts struct {
	// projections are by result (resultChanged…); guards by guard name,
	// notifications by kind and result; the maps are made when first
	// needed.
	projections   [numResults]uint64
	guards        map[string]uint64
	notifications map[notifyCount]uint64
}

// notifyCount is a series of kvmount_notify_total.
type notifyCount struct{ kind, result string }

// countsOf returns the counters of mount, made when first needed. Callers
// hold s.mu.
func (s *Server) countsOf(mount string) *mountCounts {
	c := s.counts[mount]
	if c == nil {
		c = &mountCounts{}
		s.counts[mount] = c
	}
	return c
}

// count counts ev in the counters of the mount it concerns, if any: a
// projection by its result, a failure but of a clean-up (teardown,
// collect), a guard's refusal whatever the operation. Callers hold s.mu.
func (s *Server) count(ev reconcile.Event) {
	switch ev := ev.(type) {
	case reconcile.ProjectedEvent:
		c := s.countsOf(ev.Mount)
		if ev.Change.Empty() {
			c.projections[resultUnchanged]++
		} else {
			c.projections[resultChanged]++
		}
	case reconcile.FailedEvent:
		cleanup := ev.Op == "teardown" || ev.Op == "collect"
		if cleanup && ev.Guard == "" {
			return
		}
		c := s.countsOf(ev.Mount)
		if !cleanup {
			c.projections[resultFailed]++
		}
		if ev.Guard != "" {
			c.guard(ev.Guard)
		}
	case reconcile.HeldBackEvent:
		c := s.countsOf(ev.Mount)
		c.projections[resultHeldBack]++
		c.guard(ev.Guard)
	}
}

// guard counts one refusal by the guard rail named guard.
func (c *mountCounts) guard(guard string) {
	if c.guards == nil {
		c.guards = map[string]uint64{}
	}
	c.guards[guard]++
}

// notified counts one notification attempt of kind, successful or not.
func (c *mountCounts) notified(kind string, ok bool) {
	result := "success"
	if !ok {
		result = "failure"
	}
	if c.notifications == nil {
		c.notifications = map[notifyCount]uint64{}
	}
	c.notifications[notifyCount{kind, result}]++
}

// mountCollector exports the series of each mount, made at each scrape
// from what the Server keeps of the mount anyway (its MountStatus) and its
// counters: a mount's series kept as the client library's own would be
// six or more objects of about 350 bytes each (2.1 MB for 1,000 mounts),
// made during a cold start among its garbage. A mount's series go with
// its status and counters: a mount no longer configured has none once
// torn down.
type mountCollector struct {
	s                                                 *Server
	projected, lastSuccess, lastChange, files, bytes  *prometheus.Desc
	projections, guards, notifications, notifyFailing *prometheus.Desc
}

func newMountCollector(s *Server) *mountCollector {
	mount := []string{"mount"}
	return &mountCollector{
		s:             s,
		projected:     prometheus.NewDesc("kvmount_mount_projected", "1 when the mount holds its current desired payload, else 0.", mount, nil),
		lastSuccess:   prometheus.NewDesc("kvmount_mount_last_success_timestamp_seconds", "When the mount last held, or was made to hold, its desired payload (Unix time).", mount, nil),
		lastChange:    prometheus.NewDesc("kvmount_mount_last_change_timestamp_seconds", "When the mount last switched to a version that changed it (Unix time).", mount, nil),
		files:         prometheus.NewDesc("kvmount_mount_files", "Files in the mount's current version.", mount, nil),
		bytes:         prometheus.NewDesc("kvmount_mount_bytes", "Bytes of file data in the mount's current version.", mount, nil),
		projections:   prometheus.NewDesc("kvmount_projections_total", "Setups, remounts and repairs of a mount, by result: changed, unchanged, failed or held_back.", []string{"mount", "result"}, nil),
		guards:        prometheus.NewDesc("kvmount_guard_rejections_total", "Payloads a guard rail refused or held back: check_command, size_limit, min_keys, allow_empty, max_value_size, max_mount_size or max_files; mount_dir_replaced, a mount directory refused because its path reaches another directory than the one kvmount owns; and mount_dir_unrecognized, one refused because its file system keeps no marker and was renumbered or replaced (kvmount adopt takes it over).", []string{"mount", "guard"}, nil),
		notifications: prometheus.NewDesc("kvmount_notify_total", "Notification attempts, by kind and result (success or failure).", []string{"mount", "kind", "result"}, nil),
		notifyFailing: prometheus.NewDesc("kvmount_mount_notify_failing", "1 while the last attempt to notify of the mount's current version failed (it is retried with backoff), else 0.", mount, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *mountCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.projected, c.lastSuccess, c.lastChange, c.files, c.bytes, c.projections, c.guards, c.notifications, c.notifyFailing} {
		ch <- d
	}
}

// mountRow is what Collect exports of one mount, copied under the
// Server's lock.
type mountRow struct {
	name                    string
	passed, projected       bool
	lastSuccess, lastChange float64 // Unix seconds; 0: never
	files, bytes            float64
	notified, notifyFailing bool
	counts                  mountCounts
}

// Collect implements prometheus.Collector. It holds the Server's lock only
// to copy what it exports.
func (c *mountCollector) Collect(ch chan<- prometheus.Metric) {
	c.s.mu.Lock()
	rows := make([]mountRow, 0, len(c.s.mounts))
	for name, m := range c.s.mounts {
		r := mountRow{name: name, passed: m.pass.Name != "", projected: m.pass.Projected,
			files: float64(m.Files), bytes: float64(m.Bytes)}
		if m.LastSuccess != nil {
			r.lastSuccess = unixSeconds(*m.LastSuccess)
		}
		if m.LastChange != nil {
			r.lastChange = unixSeconds(*m.LastChange)
		}
		if n := m.LastNotification; n != nil {
			r.notified, r.notifyFailing = true, !n.OK
		}
		r.counts = c.s.counts[name].clone()
		rows = append(rows, r)
	}
	// Counters of a mount without a status: one whose teardown a guard
	// refused after the mount left the configuration.
	for name, counts := range c.s.counts {
		if c.s.mounts[name] == nil {
			rows = append(rows, mountRow{name: name, counts: counts.clone()})
		}
	}
	c.s.mu.Unlock()
	for _, m := range c.series(rows) {
		ch <- m
	}
}

// The label names of each mount's series, whose addresses the series'
// label pairs hold.
var (
	labelMount  = "mount"
	labelResult = "result"
	labelGuard  = "guard"
	labelKind   = "kind"
)

// series returns the series of rows. They are made in a few slices for
// the whole scrape, each written straight into the registry's dto.Metric
// (mountSeries.Write), where prometheus.MustNewConstMetric would make its
// label pairs, their strings, its value and itself anew for each series:
// a scrape of 1,000 mounts was 100,000 allocations. Each series' label
// pairs are in the order of their names, as prometheus.Metric's Write asks.
func (c *mountCollector) series(rows []mountRow) []*mountSeries {
	nGauges, nCounters, nPairs, nRefs, nValues := 0, 0, 0, 0, 0
	for i := range rows {
		r := &rows[i]
		nGauges += boolCount(r.passed) + 3*boolCount(r.lastSuccess != 0) + boolCount(r.lastChange != 0) + boolCount(r.notified)
		p := 0
		for _, n := range r.counts.projections {
			p += boolCount(n > 0)
		}
		g, k := len(r.counts.guards), len(r.counts.notifications)
		nCounters += p + g + k
		nPairs += 1 + p + g + 2*k
		nRefs += 1 + 2*p + 2*g + 3*k
		nValues += g + 2*k
	}
	// Each object is taken from its slice by append, at the address it
	// keeps: a slice the counts above fell short of grows, and the
	// objects taken before stay where they are.
	series := make([]mountSeries, 0, nGauges+nCounters)
	gauges := make([]dto.Gauge, 0, nGauges)
	counters := make([]dto.Counter, 0, nCounters)
	pairs := make([]dto.LabelPair, 0, nPairs)
	refs := make([]*dto.LabelPair, 0, nRefs)
	values := make([]string, 0, nValues)
	out := make([]*mountSeries, 0, nGauges+nCounters)
	pair := func(name, value *string) *dto.LabelPair {
		pairs = append(pairs, dto.LabelPair{Name: name, Value: value})
		return &pairs[len(pairs)-1]
	}
	value := func(v string) *string {
		values = append(values, v)
		return &values[len(values)-1]
	}
	// add returns a new series of d with value v and the label pairs
	// labels; the caller sets its gauge or counter.
	add := func(d *prometheus.Desc, v float64, labels []*dto.LabelPair) *mountSeries {
		series = append(series, mountSeries{desc: d, value: v, labels: labels})
		m := &series[len(series)-1]
		out = append(out, m)
		return m
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...*dto.LabelPair) {
		start := len(refs)
		refs = append(refs, labels...)
		m := add(d, float64(v), refs[start:len(refs):len(refs)])
		counters = append(counters, dto.Counter{Value: &m.value})
		m.counter = &counters[len(counters)-1]
	}
	for i := range rows {
		r := &rows[i]
		mount := pair(&labelMount, &r.name)
		// The series of this mount's one label share one slice of it.
		start := len(refs)
		refs = append(refs, mount)
		single := refs[start:len(refs):len(refs)]
		gauge := func(d *prometheus.Desc, v float64) {
			m := add(d, v, single)
			gauges = append(gauges, dto.Gauge{Value: &m.value})
			m.gauge = &gauges[len(gauges)-1]
		}
		if r.passed {
			gauge(c.projected, boolValue(r.projected))
		}
		if r.lastSuccess != 0 {
			gauge(c.lastSuccess, r.lastSuccess)
			gauge(c.files, r.files)
			gauge(c.bytes, r.bytes)
		}
		if r.lastChange != 0 {
			gauge(c.lastChange, r.lastChange)
		}
		for j, n := range r.counts.projections {
			if n > 0 {
				counter(c.projections, n, mount, pair(&labelResult, &resultNames[j]))
			}
		}
		for guard, n := range r.counts.guards {
			counter(c.guards, n, pair(&labelGuard, value(guard)), mount)
		}
		for k, n := range r.counts.notifications {
			counter(c.notifications, n, pair(&labelKind, value(k.kind)), mount, pair(&labelResult, value(k.result)))
		}
		if r.notified {
			gauge(c.notifyFailing, boolValue(r.notifyFailing))
		}
	}
	return out
}

// mountSeries is one series of a mount, made by mountCollector.series
// for one scrape: a prometheus.Metric that writes its label pairs and
// value as they are. Either gauge or counter is set, its Value pointing
// at value.
type mountSeries struct {
	desc    *prometheus.Desc
	labels  []*dto.LabelPair
	value   float64
	gauge   *dto.Gauge
	counter *dto.Counter
}

// Desc implements prometheus.Metric.
func (m *mountSeries) Desc() *prometheus.Desc { return m.desc }

// Write implements prometheus.Metric: out holds m's label pairs and value
// from then on, which no one changes (the registry treats a written
// dto.Metric as immutable).
func (m *mountSeries) Write(out *dto.Metric) error {
	out.Label, out.Gauge, out.Counter = m.labels, m.gauge, m.counter
	return nil
}

// boolCount returns 1 for true and 0 for false.
func boolCount(b bool) int {
	if b {
		return 1
	}
	return 0
}

// clone returns a copy of c that shares nothing with it; the zero
// counts for nil.
func (c *mountCounts) clone() mountCounts {
	if c == nil {
		return mountCounts{}
	}
	return mountCounts{projections: c.projections, guards: maps.Clone(c.guards), notifications: maps.Clone(c.notifications)}
}

// unixSeconds returns t as Unix time in seconds, with its fraction.
func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }
