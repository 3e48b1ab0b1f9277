package source

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Retry delays of sources: jittered exponential backoff from RetryMin to
// RetryMax, never giving up.
const (
	RetryMin = 500 * time.Millisecond
	RetryMax = 30 * time.Second
)

// NewBackoff returns the jittered exponential backoff every source uses
// between failed reads: RetryMin doubling to RetryMax, ±20 % jitter, no end.
func NewBackoff() *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval = RetryMin
	b.MaxInterval = RetryMax
	b.Multiplier = 2
	b.RandomizationFactor = 0.2
	b.MaxElapsedTime = 0
	b.Reset()
	return b
}

// Sleep waits for d or until ctx is done, and reports whether d passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// Jitter returns d varied by up to ±10 %, so that many pollers do not fire in
// step.
func Jitter(d time.Duration) time.Duration {
	return d + time.Duration((rand.Float64()*0.2-0.1)*float64(d))
}
