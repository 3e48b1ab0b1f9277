package admin

import (
	"runtime"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/reconcile"
)

// metrics are kvmount's Prometheus metrics of the whole daemon and of its
// sources. Names follow Prometheus' conventions (base units, _total for
// counters, _seconds); labels carry mount, source, kind and result names,
// never keys or values. The series of each mount are mountCollector's.
type metrics struct {
	duration       prometheus.Histogram
	notifyDuration *prometheus.HistogramVec
	sourceUp       *prometheus.GaugeVec
	sourceErrors   *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer, version string) *metrics {
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "kvmount_build_info",
		Help:        "Always 1; the labels say which kvmount runs.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version()},
	})
	build.Set(1)
	m := &metrics{
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvmount_projection_duration_seconds",
			Help:    "Time of a setup, remount or repair that changed a mount, from the start of the operation to the switch and clean-up.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		notifyDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvmount_notify_duration_seconds",
			Help:    "Time of one notification attempt.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}, []string{"kind"}),
		sourceUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "kvmount_source_up",
			Help: "1 while the source can be read, else 0."}, []string{"source"}),
		sourceErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvmount_source_errors_total",
			Help: "Times the source became unreadable."}, []string{"source"}),
	}
	reg.MustRegister(build, m.duration, m.notifyDuration, m.sourceUp, m.sourceErrors)
	return m
}

// observe updates the metrics from one reconciler event.
func (m *metrics) observe(ev reconcile.Event) {
	switch ev := ev.(type) {
	case reconcile.ProjectedEvent:
		if !ev.Change.Empty() {
			m.duration.Observe(ev.Duration.Seconds())
		}
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

// notified records the duration of one notification attempt.
func (m *metrics) notified(r notify.Result) {
	m.notifyDuration.WithLabelValues(r.Kind).Observe(r.Duration.Seconds())
}
