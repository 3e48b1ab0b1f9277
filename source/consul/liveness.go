package consul

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/source"
)

// Liveness. A blocking query parked on the agent says nothing while it
// waits: a frozen agent, a frozen server the agent forwards to, a cluster
// that lost its quorum or its leader all leave it waiting — for up to
// wait + wait/16, five minutes by default — and the headers it finally
// returns with (X-Consul-KnownLeader, X-Consul-LastContact) are those of
// its last run. So a source probes, as the etcd source's stall detection
// does, with a read of its own: every probe_interval (±10 %), a
// non-blocking read of one key in stale mode, answered by whichever
// server the agent forwards to. The probe passes when an answer comes
// within probeTimeout from a server that knows a leader
// (X-Consul-KnownLeader) and heard from it within max_stale
// (X-Consul-LastContact; 0 on the leader itself): a frozen agent or server
// times out; a cluster without quorum has no leader within the raft
// leader lease; a frozen leader's followers stop hearing from it.
//
// While the probe fails, every follower of the source is reported stale
// with its error (their content stays), what the queries read is kept but
// not published, and the queries are started again — a query parked on a
// frozen server would lag silently once a new leader serves. Once a probe
// passes, the queries are started again with a non-blocking read, so that
// what changed meanwhile is read before the source is reported current.
// While failing, the probe runs twice as often, so that a heal is seen
// within half an interval.
//
// A query that failed by the store's fault — an answer of 5xx, none at
// all, a server without a leader — waits out the sources' backoff
// (source.NewBackoff), or until the probe next passes, whichever comes
// first: when the quorum comes back, a leader is elected and the agent's
// connections to it are made anew, queries that fail for a second or two
// after the probe passed again would otherwise wait 2, 4, 8 s before
// their next try, where the cluster serves within one probe interval. So
// a query tries again at most once per probe_interval beside its
// backoff, and only while the probe passes. An answer of 4xx (a token
// refused, a rate limit) or a response past the mounts' limits is the
// request's own, not the store's: its query keeps to its backoff alone.

// Liveness defaults.
const (
	// DefaultProbeInterval is how often a source probes its agent.
	DefaultProbeInterval = time.Second
	// DefaultMaxStale is the longest a server's last contact with the
	// leader may be for its answer to count as current.
	DefaultMaxStale = 2 * time.Second
	// probeTimeout bounds one probe: a non-blocking read of one key takes
	// milliseconds through a healthy agent.
	probeTimeout = 2 * time.Second
)

// errUnhealthy wraps every failure of the probe.
var errUnhealthy = errors.New("consul liveness probe")

// probeKey returns the key the probe reads: the shortest prefix a follower
// follows — a key the source's token may read —, "" when a follower
// follows all of KV (the probe then asks /v1/status/leader).
func (s *Source) probeKey() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	key := ""
	for i, st := range s.followers {
		if i == 0 || len(st.prefix) < len(key) {
			key = st.prefix
		}
	}
	return key
}

// probe reads the agent once, as the package comment says, and returns nil
// when it passes, else why not (wrapping errUnhealthy).
func (s *Source) probe(ctx context.Context) error {
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	q := (&api.QueryOptions{AllowStale: true}).WithContext(pctx)
	var err error
	var meta *api.QueryMeta
	if key := s.probeKey(); key != "" {
		_, meta, err = s.client.KV().Get(key, q)
		if statusOf(err) == http.StatusForbidden {
			key = "" // the token may list the prefix but not read it as a key
		}
		if key == "" {
			meta = nil
		}
	}
	if meta == nil && (err == nil || statusOf(err) == http.StatusForbidden) {
		var leader string
		leader, err = s.client.Status().LeaderWithQueryOptions(q)
		if err == nil && leader == "" {
			return fmt.Errorf("%w: the Consul servers have no leader", errUnhealthy)
		}
		return wrapProbe(ctx, pctx, err)
	}
	if err != nil {
		return wrapProbe(ctx, pctx, err)
	}
	return judge(meta, s.cfg.MaxStale)
}

// wrapProbe returns the probe's error err, saying when it is a timeout.
func wrapProbe(ctx, pctx context.Context, err error) error {
	switch {
	case err == nil:
		return nil
	case ctx.Err() == nil && errors.Is(pctx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("%w: no answer from the agent within %v (the agent, or the server it forwards to, does not answer)", errUnhealthy, probeTimeout)
	}
	return fmt.Errorf("%w: %w", errUnhealthy, err)
}

// judge returns why an answer described by meta cannot be taken as
// current: its server knows no leader, or last heard from it longer than
// maxStale ago; nil when it can.
func judge(meta *api.QueryMeta, maxStale time.Duration) error {
	switch {
	case !meta.KnownLeader:
		return fmt.Errorf("%w: the Consul server that answered knows no leader (X-Consul-KnownLeader: false)", errUnhealthy)
	case meta.LastContact > maxStale:
		return fmt.Errorf("%w: the Consul server that answered last heard from the leader %v ago, more than max_stale (%v)", errUnhealthy,
			meta.LastContact.Round(time.Millisecond), maxStale)
	}
	return nil
}

// statusOf returns the HTTP status of a Consul API error, 0 for others.
func statusOf(err error) int {
	var se api.StatusError
	if errors.As(err, &se) {
		return se.Code
	}
	return 0
}

// liveness probes until ctx is done, and tells the source of each change
// between passing and failing (setHealth).
func (s *Source) liveness(ctx context.Context) {
	var failing bool
	for {
		interval := s.cfg.ProbeInterval
		if interval <= 0 {
			interval = DefaultProbeInterval
		}
		if failing {
			interval /= 2
		}
		if !source.Sleep(ctx, source.Jitter(interval)) {
			return
		}
		err := s.probe(ctx)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			s.notePass()
		}
		if (err != nil) != failing {
			failing = err != nil
			s.setHealth(err)
		}
	}
}

// setHealth records the probe's outcome err (nil: it passes). A new
// failure is reported to every follower and the queries are started
// again; a pass after failures starts them again too, with a fresh read,
// whose answers report the followers current.
func (s *Source) setHealth(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unhealthy = err
	if err != nil {
		s.log.Warn("source unavailable, keeping last content", "err", err)
	} else {
		s.log.Info("source answers again; reading every prefix afresh")
	}
	if err != nil {
		for _, st := range s.followers {
			if text := err.Error(); st.errText != text {
				st.pub.Status(err)
				st.errText = text
			}
		}
	}
	if s.regroup != nil {
		s.regroup()
	}
}

// notePass wakes the queries waiting for the probe's next pass (nextPass).
func (s *Source) notePass() {
	s.mu.Lock()
	close(s.passed)
	s.passed = make(chan struct{})
	s.mu.Unlock()
}

// nextPass returns a channel closed when the liveness probe next passes.
func (s *Source) nextPass() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.passed
}

// backOff waits d after a query's failure err, or less when err is the
// store's fault and the liveness probe passes meanwhile (the package
// comment says why); it reports false when ctx ends first.
func (s *Source) backOff(ctx context.Context, d time.Duration, err error) bool {
	var passed <-chan struct{}
	if storeFault(err) {
		passed = s.nextPass()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-passed:
		return true
	case <-ctx.Done():
		return false
	}
}

// storeFault reports whether a query's failure err is the store's — no
// answer, or an answer of 5xx — rather than the request's own: an answer
// of 4xx (a token refused, 429's rate limit) or one past the mounts'
// limits (source.ErrOverLimits), which no sooner try would change.
func storeFault(err error) bool {
	if errors.Is(err, source.ErrOverLimits) {
		return false
	}
	code := statusOf(err)
	return code == 0 || code >= 500
}
