// Package admin is kvmount's endpoint for operators: /metrics (Prometheus
// text format, with the Go and process collectors), /healthz (the
// reconciler's loop answers) and /readyz (every non-optional mount holds
// its current desired payload and no source it uses is stale) on loopback
// TCP for anyone there; the same and /status (JSON, per mount, source and
// endpoint) on a unix socket only root can use, which kvmount status
// reads. Both are bounded — connections, time, header size — so that no
// client can starve the daemon, and both listen in the background:
// projection never waits for them.
//
// It consumes the reconciler's event stream (reconcile.Observer) and the
// notifier's results; the reconciler does not know it exists.
package admin

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/reconcile"
)

// pingTimeout bounds how long /healthz waits for the reconciler's loop.
const pingTimeout = 2 * time.Second

// Options configure a Server.
type Options struct {
	// Version is reported in kvmount_build_info.
	Version string
	// Ping asks the reconciler's loop to answer; /healthz is 200 when it
	// does within 2 s.
	Ping func(ctx context.Context) error
	// Log receives the server's errors.
	Log *slog.Logger
	// Adopt, when set, serves POST /adopt?mount=NAME on the private
	// endpoint only (kvmount adopt): it takes the directory the mount's
	// path reaches for the mount's own (reconcile.Reconciler.Adopt).
	Adopt func(ctx context.Context, mount string) error
	// Workers, when set, returns the state of the unprivileged workers,
	// one per trust domain, for /status and the kvmount_worker_* metrics
	// (labelled by domain). It is called at each request and scrape, and
	// must not block.
	Workers func() []*WorkerStatus
}

// Server holds what kvmount knows of its mounts and sources and serves it.
type Server struct {
	opts    Options
	reg     *prometheus.Registry
	metrics *metrics

	mu     sync.Mutex
	mounts map[string]*MountStatus
	// counts are each mount's counters, for its metrics
	// (mountCollector); they go with its status.
	counts        map[string]*mountCounts
	sources       map[string]*SourceStatus
	endpointState map[string]*EndpointStatus
	passes        int

	// epMu guards the listening endpoints (serve.go).
	epMu      sync.Mutex
	endpoints map[string]*endpoint
	stopped   bool
}

// Status is what /status serves.
type Status struct {
	// Ready is what /readyz answers: every non-optional mount holds its
	// current desired payload and no source it uses is stale. It is about
	// the files: a mount whose notification fails (notify_failed) holds
	// the right files and is ready. Reasons say why not.
	Ready   bool     `json:"ready"`
	Reasons []string `json:"reasons,omitempty"`
	// Mounts and Sources by name.
	Mounts  map[string]*MountStatus  `json:"mounts"`
	Sources map[string]*SourceStatus `json:"sources"`
	// Endpoints are the admin endpoints, sorted by address.
	Endpoints []*EndpointStatus `json:"endpoints"`
	// Workers are the unprivileged workers that read the sources, one per
	// trust domain, by domain name; none when kvmount reads them in its
	// own process.
	Workers []*WorkerStatus `json:"workers,omitempty"`
	// brief are Reasons without the errors' text, for the public
	// /readyz.
	brief []string
}

// Mount states in MountStatus.State.
const (
	StateCurrent = "current" // holds its current desired payload
	// StateNotifyFailed: holds its current desired payload, but the last
	// attempt to notify of it failed (and is retried with backoff): the
	// files are right, the service reading them may not have reloaded.
	StateNotifyFailed = "notify_failed"
	StatePending      = "pending"  // a newer payload is being written or waits for quiescence
	StateWaiting      = "waiting"  // no snapshot yet from a source
	StateStale        = "stale"    // a source cannot be read, or an update is held back
	StateFailed       = "failed"   // the payload cannot be built, or the last write failed
	StateOptional     = "optional" // an optional mount not projected
)

// MountStatus is one mount's entry in /status.
type MountStatus struct {
	Dir    string `json:"dir"`
	Medium string `json:"medium"`
	// State is one of the State constants.
	State    string `json:"state"`
	Optional bool   `json:"optional"`
	// Version is the version directory ..data names; Revision the
	// snapshots it was built from, per projection ("main@1042,web@abc").
	Version  string `json:"version,omitempty"`
	Revision string `json:"revision,omitempty"`
	Files    int    `json:"files"`
	Bytes    int64  `json:"bytes"`
	// LastSuccess is the last time the mount was found or made to hold
	// its desired payload; LastChange the last switch that changed it.
	LastSuccess *time.Time `json:"last_success,omitempty"`
	LastChange  *time.Time `json:"last_change,omitempty"`
	// StaleSince is when it last became stale; nil while it is not.
	StaleSince *time.Time `json:"stale_since,omitempty"`
	// LastError is the error that keeps it from being current, if any.
	LastError string `json:"last_error,omitempty"`
	// LastNotification is the result of the last notification attempt.
	LastNotification *NotificationStatus `json:"last_notification,omitempty"`
	// pass is the mount's status after the reconciler's last pass.
	pass reconcile.MountStatus
}

// NotificationStatus is the last notification attempt of a mount.
type NotificationStatus struct {
	Kind    string    `json:"kind"`
	Target  string    `json:"target"`
	Version string    `json:"version"`
	OK      bool      `json:"ok"`
	Error   string    `json:"error,omitempty"`
	Attempt int       `json:"attempt"`
	Time    time.Time `json:"time"`
}

// SourceStatus is one source's entry in /status.
type SourceStatus struct {
	Up        bool   `json:"up"`
	LastError string `json:"last_error,omitempty"`
	// Revision is the newest revision seen from it.
	Revision string `json:"revision,omitempty"`
}

// New returns a Server with its metrics registered.
func New(opts Options) *Server {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	s := &Server{opts: opts, reg: reg, metrics: newMetrics(reg, opts.Version), mounts: map[string]*MountStatus{}, counts: map[string]*mountCounts{}, sources: map[string]*SourceStatus{},
		endpointState: map[string]*EndpointStatus{}, endpoints: map[string]*endpoint{}}
	reg.MustRegister(newMountCollector(s))
	if opts.Workers != nil {
		reg.MustRegister(newWorkerCollector(opts.Workers))
	}
	return s
}

var _ reconcile.Observer = (*Server)(nil)

// Observe records one event of the reconciler (see reconcile.Observer).
// It never blocks for long.
func (s *Server) Observe(ev reconcile.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.metrics.observe(ev)
	s.count(ev)
	switch ev := ev.(type) {
	case reconcile.PassEvent:
		s.passes++
		for _, st := range ev.Mounts {
			m := s.mount(st.Name)
			m.Dir, m.Medium, m.Optional = st.Dir, st.Medium, st.Optional
			prev := m.State
			m.pass = st
			m.State, m.LastError = MountState(st, notifyError(m))
			if m.State == StateStale && prev != StateStale {
				t := ev.Time
				m.StaleSince = &t
			} else if m.State != StateStale {
				m.StaleSince = nil
			}
		}
		for name := range removed(s.mounts, ev.Mounts) {
			delete(s.mounts, name)
			delete(s.counts, name)
		}
	case reconcile.ProjectedEvent:
		m := s.mount(ev.Mount)
		m.Version, m.Revision, m.Files, m.Bytes = ev.Version, ev.Revision, ev.Files, ev.Bytes
		t := ev.Time
		m.LastSuccess = &t
		if !ev.Change.Empty() {
			m.LastChange = &t
		}
	case reconcile.TornDownEvent:
		delete(s.mounts, ev.Mount)
		delete(s.counts, ev.Mount)
	case reconcile.SourceEvent:
		src := s.sources[ev.Source]
		if src == nil {
			src = &SourceStatus{}
			s.sources[ev.Source] = src
		}
		src.Up = ev.Err == nil
		src.LastError = ""
		if ev.Err != nil {
			src.LastError = ev.Err.Error()
		}
		if ev.Revision != "" {
			src.Revision = ev.Revision
		}
	}
}

// NotifyResult records the result of one notification attempt.
func (s *Server) NotifyResult(r notify.Result) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.metrics.notified(r)
	n := &NotificationStatus{Kind: r.Kind, Target: r.Target, Version: r.Version, OK: r.Err == nil, Attempt: r.Attempt, Time: r.Time}
	if r.Err != nil {
		n.Error = r.Err.Error()
	}
	s.countsOf(r.Mount).notified(r.Kind, r.Err == nil)
	m := s.mount(r.Mount)
	m.LastNotification = n
	if m.pass.Name != "" {
		m.State, m.LastError = MountState(m.pass, notifyError(m))
	}
}

// mount returns the status of name, creating it; s.mu must be held.
func (s *Server) mount(name string) *MountStatus {
	m := s.mounts[name]
	if m == nil {
		m = &MountStatus{State: StateWaiting}
		s.mounts[name] = m
	}
	return m
}

// removed yields the names in known that are not in mounts, given that
// every name in mounts is in known (and each once): none, without a look
// at either, when both have as many. A pass reports every mount, and the
// mounts rarely change.
func removed[V any](known map[string]V, mounts []reconcile.MountStatus) iter.Seq[string] {
	return func(yield func(string) bool) {
		if len(known) == len(mounts) {
			return
		}
		seen := make(map[string]bool, len(mounts))
		for _, st := range mounts {
			seen[st.Name] = true
		}
		for name := range known {
			if !seen[name] && !yield(name) {
				return
			}
		}
	}
}

// MountState returns the state of a mount, and why it is not current:
// from its status after the reconciler's last pass and the error of its
// last notification attempt ("" when that succeeded, or none was made).
// These are the words /status, kvmount status and systemd's status line
// all use: current, notify_failed, pending, waiting, stale, failed,
// optional.
func MountState(st reconcile.MountStatus, notifyErr string) (state, why string) {
	switch {
	case st.Err != nil:
		return StateFailed, st.Err.Error()
	case len(st.Stale) > 0:
		return StateStale, errors.Join(st.Stale...).Error()
	case st.Projected && notifyErr != "":
		return StateNotifyFailed, notifyErr
	case st.Projected:
		return StateCurrent, ""
	case len(st.Waiting) > 0:
		if st.Optional {
			return StateOptional, ""
		}
		return StateWaiting, "no snapshot yet from " + strings.Join(st.Waiting, ", ")
	}
	return StatePending, ""
}

// notifyError is the error of m's last notification attempt, "" when it
// succeeded or none was made.
func notifyError(m *MountStatus) string {
	if n := m.LastNotification; n != nil && !n.OK {
		return fmt.Sprintf("notification %s %s: %s", n.Kind, n.Target, n.Error)
	}
	return ""
}

// Status returns a copy of what /status serves.
func (s *Server) Status() Status {
	var workers []*WorkerStatus
	if s.opts.Workers != nil {
		workers = s.opts.Workers()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Status{Mounts: map[string]*MountStatus{}, Sources: map[string]*SourceStatus{}, Ready: s.passes > 0, Workers: workers}
	if s.passes == 0 {
		st.Reasons = append(st.Reasons, "the reconciler has not made its first pass")
		st.brief = st.Reasons
	}
	for name, m := range s.mounts {
		c := *m
		st.Mounts[name] = &c
		if !m.Optional && m.State != StateCurrent && m.State != StateNotifyFailed {
			st.Ready = false
			reason := fmt.Sprintf("mount %s is %s", name, m.State)
			st.brief = append(st.brief, reason)
			if m.LastError != "" {
				reason += ": " + m.LastError
			}
			st.Reasons = append(st.Reasons, reason)
		}
	}
	for name, src := range s.sources {
		c := *src
		st.Sources[name] = &c
	}
	for _, ep := range s.endpointState {
		c := *ep
		st.Endpoints = append(st.Endpoints, &c)
	}
	slices.SortFunc(st.Endpoints, func(a, b *EndpointStatus) int { return strings.Compare(a.Address, b.Address) })
	slices.Sort(st.Reasons)
	slices.Sort(st.brief)
	return st
}
