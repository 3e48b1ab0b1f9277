package vault

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// renewal is the schedule of one lease's renewals — the source's token, or
// the lease of a dynamic secret — kept by kvmount rather than by the API
// client's LifetimeWatcher, whose backoff (v4) returns no delay once a
// lease's remaining time is exceeded and then renews as fast as the
// network allows (hashicorp/vault#28611). It is a pure function of the
// clock readings and outcomes it is given; the caller sends the requests.
//
// The rules, as vault-agent's: renew at two thirds of the lease's
// duration, asking for its first duration again (the increment); a lease
// that is not renewable, or whose renewal came back shorter than asked
// (its maximum TTL is near), is replaced — the secret read again, the
// token logged in again — at two thirds of what it has left. A failed
// renewal is retried with jittered exponential backoff, each delay at most
// a quarter of the time the lease has left, until the lease has less than
// a tenth of its duration left (at least giveUpFloor): then it is
// replaced, before it ends. A 403 ends the renewals at once (the caller
// tells a revoked token from one that may not renew itself); a 400
// ("lease not found", as a new active node may answer while it restores
// its leases after a failover) is retried at most badRequestRetries times.
type renewal struct {
	// increment is the duration asked for at each renewal: the lease's
	// duration when it was granted.
	increment time.Duration
	// start and ttl are the current grant: from start, the lease lasts ttl.
	start time.Time
	ttl   time.Duration
	// renewable is false once Vault says the lease cannot be renewed, or
	// its maximum TTL caps it.
	renewable bool
	// capped is true once a renewal came back shorter than asked.
	capped bool

	bo *backoff.ExponentialBackOff
	// pace, when not nil, may lengthen a retry's wait (Source.retryDelay).
	pace func(time.Duration) time.Duration
	// retryAt is when a failed renewal is tried again; zero when the last
	// attempt succeeded.
	retryAt time.Time
	// badRequests counts consecutive 400 answers.
	badRequests int
	// ended, when not "", is why the lease must be replaced now; refused
	// is true when that is a 403.
	ended   string
	refused bool
	// lastErr is the last renewal's failure.
	lastErr error
}

// Bounds of renewal retries.
const (
	// giveUpFloor is the least time a lease must have left for a failed
	// renewal to be retried rather than the lease replaced.
	giveUpFloor = time.Second
	// badRequestRetries is how many 400 answers in a row are retried.
	badRequestRetries = 3
)

// Why a lease is replaced, as the log says it.
const (
	whyMaxTTL       = "it cannot be renewed beyond its maximum TTL"
	whyNotRenewable = "it is not renewable"
)

// newRenewal returns the schedule of a lease granted at start for ttl;
// retries back off from source.RetryMin up to retryCap, and pace (nil for
// none) may lengthen each wait.
func newRenewal(start time.Time, ttl time.Duration, renewable bool, retryCap time.Duration, pace func(time.Duration) time.Duration) *renewal {
	return &renewal{increment: ttl, start: start, ttl: ttl, renewable: renewable, bo: newRetryBackoff(retryCap), pace: pace}
}

// expires returns when the lease ends.
func (r *renewal) expires() time.Time { return r.start.Add(r.ttl) }

// next returns when the caller acts next, and whether that act is to
// replace the lease (true) or to renew it (false).
func (r *renewal) next() (at time.Time, replace bool) {
	switch {
	case r.ended != "":
		return time.Time{}, true
	case !r.renewable || r.capped:
		return r.start.Add(r.ttl * 2 / 3), true
	case !r.retryAt.IsZero():
		return r.retryAt, false
	}
	return r.start.Add(r.ttl * 2 / 3), false
}

// attemptLimit returns how long a renewal sent at now may take: half the
// time the lease has left (at least giveUpFloor), so that a request held
// by a node that does not answer leaves time to retry through another.
func (r *renewal) attemptLimit(now time.Time) time.Duration {
	return max(r.expires().Sub(now)/2, giveUpFloor)
}

// attemptFailure returns err, the failure of a renewal attempt whose
// context attempt ended after limit, in words: a deadline of the attempt's
// own says that no answer came within half the time the lease had left.
func attemptFailure(err error, attempt context.Context, limit time.Duration) error {
	if errors.Is(attempt.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("no answer within %v, half the time it had left", limit.Round(time.Millisecond))
	}
	return describe(err)
}

// why returns why the lease is replaced.
func (r *renewal) why() string {
	switch {
	case r.ended != "":
		return r.ended
	case r.capped:
		return whyMaxTTL
	}
	return whyNotRenewable
}

// renewed records a renewal sent at sent that granted ttl.
func (r *renewal) renewed(sent time.Time, ttl time.Duration, renewable bool) {
	r.start, r.ttl, r.renewable = sent, ttl, renewable
	r.retryAt, r.badRequests, r.lastErr = time.Time{}, 0, nil
	r.bo.Reset()
	// Vault grants whole seconds: anything under nine tenths of the
	// increment is its maximum TTL at work.
	if ttl < r.increment*9/10 {
		r.capped = true
	}
}

// failed records a renewal that failed at now with err, and returns how
// long until it is tried again (0 when the lease is to be replaced now).
func (r *renewal) failed(now time.Time, err error) time.Duration {
	r.lastErr = err
	left := r.expires().Sub(now)
	giveUp := max(r.increment/10, giveUpFloor)
	switch status := statusOf(err); {
	case status == http.StatusForbidden:
		r.ended, r.refused = "Vault refused its renewal (403)", true
		return 0
	case status == http.StatusBadRequest && r.badRequests >= badRequestRetries-1:
		r.ended = fmt.Sprintf("renewing it failed %d times in a row: %v", badRequestRetries, err)
		return 0
	case left <= giveUp:
		r.ended = fmt.Sprintf("renewing it failed with %s left: %v", left.Round(time.Second), err)
		return 0
	case status == http.StatusBadRequest:
		r.badRequests++
	default:
		r.badRequests = 0
	}
	wait := min(r.bo.NextBackOff(), max(left/4, time.Duration(0)))
	wait = max(wait, min(left-giveUp, retryFloor))
	if r.pace != nil {
		wait = r.pace(wait)
	}
	r.retryAt = now.Add(wait)
	return wait
}

// retryFloor is the shortest wait between two failed renewals of one
// lease, when the lease has that long left.
const retryFloor = 250 * time.Millisecond
