package admin

import (
	"runtime"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/reconcile"
)

// metrics are kvmount's Prometheus metrics. Names follow Prometheus'
// conventions (base units, _total for counters, _seconds); labels carry
// mount, source, kind and result names, never keys or values.
type metrics struct {
	projected      *prometheus.GaugeVec
	lastSuccess    *prometheus.GaugeVec
	lastChange     *prometheus.GaugeVec
	files          *prometheus.GaugeVec
	bytes          *prometheus.GaugeVec
	projections    *prometheus.CounterVec
	duration       prometheus.Histogram
	guards         *prometheus.CounterVec
	notifications  *prometheus.CounterVec
	notifyDuration *prometheus.HistogramVec
	notifyFailing  *prometheus.GaugeVec
	sourceUp       *prometheus.GaugeVec
	sourceErrors   *prometheus.CounterVec
	// known are the mounts with series, to delete those of removed mounts,
	// each with the value of its kvmount_mount_projected, set again only
	// when it changes.
	known map[string]float64
}

func newMetrics(reg prometheus.Registerer, version string) *metrics {
	f := func(c prometheus.Collector) { reg.MustRegister(c) }
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "kvmount_build_info",
		Help:        "Always 1; the labels say which kvmount runs.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version()},
	})
	build.Set(1)
	f(build)
	m := &metrics{
		projected: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_mount_projected",
			Help: "1 when the mount holds its current desired payload, else 0."}, []string{"mount"}),
		lastSuccess: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_mount_last_success_timestamp_seconds",
			Help: "When the mount last held, or was made to hold, its desired payload (Unix time)."}, []string{"mount"}),
		lastChange: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_mount_last_change_timestamp_seconds",
			Help: "When the mount last switched to a version that changed it (Unix time)."}, []string{"mount"}),
		files: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_mount_files",
			Help: "Files in the mount's current version."}, []string{"mount"}),
		bytes: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_mount_bytes",
			Help: "Bytes of file data in the mount's current version."}, []string{"mount"}),
		projections: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvmount_projections_total",
			Help: "Setups, remounts and repairs of a mount, by result: changed, unchanged, failed or held_back."}, []string{"mount", "result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvmount_projection_duration_seconds",
			Help:    "Time of a setup, remount or repair that changed a mount, from the start of the operation to the switch and clean-up.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		guards: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvmount_guard_rejections_total",
			Help: "Payloads a guard rail refused or held back: check_command, size_limit, min_keys, allow_empty, max_value_size, max_mount_size or max_files; mount_dir_replaced, a mount directory refused because its path reaches another directory than the one kvmount owns; and mount_dir_unrecognized, one refused because its file system keeps no marker and was renumbered or replaced (kvmount adopt takes it over)."}, []string{"mount", "guard"}),
		notifications: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvmount_notify_total",
			Help: "Notification attempts, by kind and result (success or failure)."}, []string{"mount", "kind", "result"}),
		notifyDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvmount_notify_duration_seconds",
			Help:    "Time of one notification attempt.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}, []string{"kind"}),
		notifyFailing: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_mount_notify_failing",
			Help: "1 while the last attempt to notify of the mount's current version failed (it is retried with backoff), else 0."}, []string{"mount"}),
		sourceUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_source_up",
			Help: "1 while the source can be read, else 0."}, []string{"source"}),
		sourceErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvmount_source_errors_total",
			Help: "Times the source became unreadable."}, []string{"source"}),
		known: map[string]float64{},
	}
	for _, c := range []prometheus.Collector{m.projected, m.lastSuccess, m.lastChange, m.files, m.bytes, m.projections,
		m.duration, m.guards, m.notifications, m.notifyDuration, m.notifyFailing, m.sourceUp, m.sourceErrors} {
		f(c)
	}
	return m
}

// observe updates the metrics from one reconciler event.
func (m *metrics) observe(ev reconcile.Event) {
	switch ev := ev.(type) {
	case reconcile.PassEvent:
		for _, st := range ev.Mounts {
			v := 0.0
			if st.Projected {
				v = 1
			}
			if last, ok := m.known[st.Name]; !ok || last != v {
				m.known[st.Name] = v
				m.projected.WithLabelValues(st.Name).Set(v)
			}
		}
		for name := range removed(m.known, ev.Mounts) {
			m.forget(name)
		}
	case reconcile.ProjectedEvent:
		t := float64(ev.Time.UnixNano()) / 1e9
		m.lastSuccess.WithLabelValues(ev.Mount).Set(t)
		m.files.WithLabelValues(ev.Mount).Set(float64(ev.Files))
		m.bytes.WithLabelValues(ev.Mount).Set(float64(ev.Bytes))
		if ev.Change.Empty() {
			m.projections.WithLabelValues(ev.Mount, "unchanged").Inc()
		} else {
			m.projections.WithLabelValues(ev.Mount, "changed").Inc()
			m.lastChange.WithLabelValues(ev.Mount).Set(t)
			m.duration.Observe(ev.Duration.Seconds())
		}
	case reconcile.FailedEvent:
		if ev.Op != "teardown" && ev.Op != "collect" {
			m.projections.WithLabelValues(ev.Mount, "failed").Inc()
		}
		if ev.Guard != "" {
			m.guards.WithLabelValues(ev.Mount, ev.Guard).Inc()
		}
	case reconcile.HeldBackEvent:
		m.projections.WithLabelValues(ev.Mount, "held_back").Inc()
		m.guards.WithLabelValues(ev.Mount, ev.Guard).Inc()
	case reconcile.TornDownEvent:
		m.forget(ev.Mount)
	case reconcile.SourceEvent:
		up := m.sourceUp.WithLabelValues(ev.Source)
		if ev.Err != nil {
			up.Set(0)
			m.sourceErrors.WithLabelValues(ev.Source).Inc()
		} else {
			up.Set(1)
		}
	}
}

// notified counts one notification attempt.
func (m *metrics) notified(r notify.Result) {
	result := "success"
	if r.Err != nil {
		result = "failure"
	}
	m.notifications.WithLabelValues(r.Mount, r.Kind, result).Inc()
	failing := 0.0
	if r.Err != nil {
		failing = 1
	}
	m.notifyFailing.WithLabelValues(r.Mount).Set(failing)
	m.notifyDuration.WithLabelValues(r.Kind).Observe(r.Duration.Seconds())
}

// forget deletes the per-mount series of a mount no longer configured.
func (m *metrics) forget(mount string) {
	delete(m.known, mount)
	labels := prometheus.Labels{"mount": mount}
	for _, v := range []*prometheus.GaugeVec{m.projected, m.lastSuccess, m.lastChange, m.files, m.bytes, m.notifyFailing} {
		v.DeletePartialMatch(labels)
	}
	for _, v := range []*prometheus.CounterVec{m.projections, m.guards, m.notifications} {
		v.DeletePartialMatch(labels)
	}
}
