package vault

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

// failure is a Vault error response of status.
func failure(status int, msg string) error { return &ResponseError{Status: status, Messages: msg} }

// TestRenewalSchedule: the renewal's decisions, step by step, against a
// clock the test moves.
func TestRenewalSchedule(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	const ttl = 30 * time.Second
	at := func(d time.Duration) time.Time { return t0.Add(d) }

	t.Run("renewed at two thirds, again and again", func(t *testing.T) {
		r := newRenewal(t0, ttl, true, 30*time.Second, nil)
		if got, replace := r.next(); !got.Equal(at(20*time.Second)) || replace {
			t.Fatalf("next = %v, %v; want renewal at +20s", got.Sub(t0), replace)
		}
		r.renewed(at(20*time.Second), ttl, true)
		if got, replace := r.next(); !got.Equal(at(40*time.Second)) || replace {
			t.Fatalf("next = %v, %v; want renewal at +40s", got.Sub(t0), replace)
		}
	})
	t.Run("capped by the maximum TTL: replaced at two thirds of what is left", func(t *testing.T) {
		r := newRenewal(t0, ttl, true, 30*time.Second, nil)
		r.renewed(at(20*time.Second), 9*time.Second, true)
		got, replace := r.next()
		if !got.Equal(at(26*time.Second)) || !replace || r.why() != whyMaxTTL {
			t.Fatalf("next = %v, %v (%s); want replace at +26s for the maximum TTL", got.Sub(t0), replace, r.why())
		}
	})
	t.Run("not renewable: replaced at two thirds", func(t *testing.T) {
		r := newRenewal(t0, ttl, false, 30*time.Second, nil)
		if got, replace := r.next(); !got.Equal(at(20*time.Second)) || !replace || r.why() != whyNotRenewable {
			t.Fatalf("next = %v, %v (%s)", got.Sub(t0), replace, r.why())
		}
	})
	t.Run("failures retried with backoff within the time left, then replaced before the end", func(t *testing.T) {
		r := newRenewal(t0, ttl, true, 30*time.Second, nil)
		now := at(20 * time.Second)
		attempts := 0
		for {
			attempts++
			wait := r.failed(now, failure(http.StatusServiceUnavailable, "Vault is sealed"))
			if wait == 0 {
				break
			}
			if left := r.expires().Sub(now); wait > left/4 && wait > retryFloor {
				t.Errorf("with %v left a retry waits %v, more than a quarter of it", left, wait)
			}
			if wait < retryFloor {
				t.Errorf("a retry after %v, under %v", wait, retryFloor)
			}
			now = now.Add(wait)
			if attempts > 40 {
				t.Fatal("renewals never gave up")
			}
		}
		if left := r.expires().Sub(now); left > 3*time.Second || left < 0 {
			t.Errorf("replaced with %v left; want the last tenth (3s) and before the end", left)
		}
		if _, replace := r.next(); !replace || !strings.Contains(r.why(), "503") {
			t.Errorf("why = %q; want the last error", r.why())
		}
		if attempts > 12 {
			t.Errorf("%d attempts in 10 s", attempts)
		}
	})
	t.Run("a success resets the backoff", func(t *testing.T) {
		r := newRenewal(t0, ttl, true, 30*time.Second, nil)
		r.failed(at(20*time.Second), failure(http.StatusInternalServerError, "local node not active"))
		r.failed(at(21*time.Second), failure(http.StatusInternalServerError, "local node not active"))
		r.renewed(at(22*time.Second), ttl, true)
		if got, replace := r.next(); !got.Equal(at(42*time.Second)) || replace {
			t.Fatalf("next = %v, %v; want renewal at +42s", got.Sub(t0), replace)
		}
		if wait := r.failed(at(42*time.Second), errors.New("connection refused")); wait > 600*time.Millisecond {
			t.Errorf("first retry after a success waits %v; want the backoff's first step", wait)
		}
	})
	t.Run("403 ends it at once", func(t *testing.T) {
		r := newRenewal(t0, ttl, true, 30*time.Second, nil)
		if wait := r.failed(at(20*time.Second), failure(http.StatusForbidden, "permission denied")); wait != 0 || !r.refused {
			t.Fatalf("wait %v, refused %v", wait, r.refused)
		}
	})
	t.Run("400 retried three times", func(t *testing.T) {
		r := newRenewal(t0, ttl, true, 30*time.Second, nil)
		now := at(20 * time.Second)
		for i := 1; ; i++ {
			wait := r.failed(now, failure(http.StatusBadRequest, "lease not found"))
			if wait == 0 {
				if i != badRequestRetries {
					t.Errorf("gave up at the %dth 400; want the %dth", i, badRequestRetries)
				}
				break
			}
			now = now.Add(wait)
		}
	})
	t.Run("pace lengthens a wait", func(t *testing.T) {
		r := newRenewal(t0, ttl, true, 30*time.Second, func(time.Duration) time.Duration { return 2 * time.Second })
		if wait := r.failed(at(20*time.Second), failure(http.StatusServiceUnavailable, "")); wait != 2*time.Second {
			t.Errorf("wait %v; want the pace's 2s", wait)
		}
		if got, _ := r.next(); !got.Equal(at(22 * time.Second)) {
			t.Errorf("retry at %v; want +22s", got.Sub(t0))
		}
	})
}

// TestRetryBefore: a PKI projection's retries come before its certificate
// expires.
func TestRetryBefore(t *testing.T) {
	now := time.Now()
	for _, c := range []struct {
		wait     time.Duration
		notAfter time.Time
		want     time.Duration
	}{
		{17 * time.Second, time.Time{}, 17 * time.Second},
		{17 * time.Second, now.Add(40 * time.Second), 10 * time.Second},
		{2 * time.Second, now.Add(40 * time.Second), 2 * time.Second},
		{17 * time.Second, now.Add(2 * time.Second), minReissue},
		{17 * time.Second, now.Add(-time.Minute), minReissue},
	} {
		if got := retryBefore(c.wait, c.notAfter, now); got != c.want {
			t.Errorf("retryBefore(%v, %v left) = %v; want %v", c.wait, c.notAfter.Sub(now), got, c.want)
		}
	}
}
