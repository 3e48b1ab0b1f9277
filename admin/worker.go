package admin

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// WorkerStatus is an unprivileged worker's entry in /status (SECURITY.md,
// "Privilege separation"): the monitor's view of it, and how the kernel
// confines it as /proc/PID/status shows — never what the worker says of
// itself.
type WorkerStatus struct {
	// Domain names the trust domain it serves (privsep.Domain): the
	// sources it reads, and the mounts that use them.
	Domain  string   `json:"domain"`
	Sources []string `json:"sources"`
	Mounts  []string `json:"mounts"`
	// Running is true while a worker runs; between a worker's end and the
	// next start (with backoff) it is false and the mounts keep their
	// content.
	Running bool `json:"running"`
	PID     int  `json:"pid,omitempty"`
	// UID is the user id the worker runs as.
	UID   int        `json:"uid"`
	Since *time.Time `json:"since,omitempty"`
	// Starts counts the workers started; Refusals those stopped for
	// breaking the protocol or a guard rail.
	Starts   uint64 `json:"starts"`
	Refusals uint64 `json:"refusals"`
	// Payloads counts the payloads its workers sent whole; Unchanged
	// those that did not cross because the mount held them on disk
	// already (privsep.Unchanged: a restart, a worker started again).
	Payloads  uint64 `json:"payloads"`
	Unchanged uint64 `json:"payloads_unchanged"`
	// LastEnd says why the last worker ended, if one did.
	LastEnd string `json:"last_end,omitempty"`
	// LandlockABI is the Landlock ABI the kernel offers the worker, 0 for
	// none; Seccomp and NoNewPrivs what /proc/PID/status shows of the
	// running worker (Seccomp: 2), and Capabilities whether any of its
	// effective, permitted or bounding sets holds one.
	LandlockABI  int  `json:"landlock_abi"`
	Seccomp      bool `json:"seccomp"`
	NoNewPrivs   bool `json:"no_new_privs"`
	Capabilities bool `json:"capabilities"`
	// Warnings say what the worker runs without: Landlock or seccomp the
	// kernel lacks, and anything the kernel shows that should not be.
	Warnings []string `json:"warnings,omitempty"`
	// InForce says, a line each, what confines the worker on this kernel
	// (privsep.InForce).
	InForce []string `json:"in_force,omitempty"`
}

// workerCollector exports Options.Workers as metrics, read at each
// scrape, a series per domain.
type workerCollector struct {
	workers                        func() []*WorkerStatus
	up, starts, refusals, landlock *prometheus.Desc
	seccomp, payloads              *prometheus.Desc
}

func newWorkerCollector(workers func() []*WorkerStatus) *workerCollector {
	domain := []string{"domain"}
	return &workerCollector{
		workers: workers,
		up:      prometheus.NewDesc("kvmount_worker_up", "1 while the unprivileged worker of the trust domain runs, else 0 (it is started again with backoff; the mounts keep their content).", domain, nil),
		starts:  prometheus.NewDesc("kvmount_worker_starts_total", "Workers of the trust domain started: the first, and one after each end.", domain, nil),
		refusals: prometheus.NewDesc("kvmount_worker_refusals_total",
			"Workers stopped for breaking the protocol or a guard rail (a path out of its mount, a payload over a limit, a malformed frame).", domain, nil),
		landlock: prometheus.NewDesc("kvmount_worker_landlock_abi", "The Landlock ABI the kernel offers the worker; 0 when it has none.", domain, nil),
		seccomp:  prometheus.NewDesc("kvmount_worker_seccomp", "1 when the running worker has a seccomp filter (/proc/PID/status Seccomp: 2), else 0.", domain, nil),
		payloads: prometheus.NewDesc("kvmount_worker_payloads_total",
			"Payloads the trust domain's workers sent that the monitor took: form=\"whole\", or form=\"unchanged\" when only the digest crossed because the mount held that payload on disk already (a restart, a worker started again).",
			[]string{"domain", "form"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *workerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.starts, c.refusals, c.landlock, c.seccomp, c.payloads} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *workerCollector) Collect(ch chan<- prometheus.Metric) {
	for _, w := range c.workers() {
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, boolValue(w.Running), w.Domain)
		ch <- prometheus.MustNewConstMetric(c.starts, prometheus.CounterValue, float64(w.Starts), w.Domain)
		ch <- prometheus.MustNewConstMetric(c.refusals, prometheus.CounterValue, float64(w.Refusals), w.Domain)
		ch <- prometheus.MustNewConstMetric(c.landlock, prometheus.GaugeValue, float64(w.LandlockABI), w.Domain)
		ch <- prometheus.MustNewConstMetric(c.seccomp, prometheus.GaugeValue, boolValue(w.Running && w.Seccomp), w.Domain)
		ch <- prometheus.MustNewConstMetric(c.payloads, prometheus.CounterValue, float64(w.Payloads), w.Domain, "whole")
		ch <- prometheus.MustNewConstMetric(c.payloads, prometheus.CounterValue, float64(w.Unchanged), w.Domain, "unchanged")
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
