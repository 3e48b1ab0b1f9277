package source

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// TestBackoffBounds: every source's retry schedule is RetryMin doubling to
// RetryMax with ±20 % jitter, and never gives up (README "What happens when
// things go wrong").
func TestBackoffBounds(t *testing.T) {
	for range 50 {
		b := NewBackoff()
		want := RetryMin
		for n := 1; n <= 20; n++ {
			d := b.NextBackOff()
			if d == backoff.Stop {
				t.Fatalf("retry %d: the backoff gave up", n)
			}
			lo, hi := time.Duration(float64(want)*0.8), time.Duration(float64(want)*1.2)
			if d < lo || d > hi {
				t.Fatalf("retry %d: %v; want within [%v, %v]", n, d, lo, hi)
			}
			want = min(2*want, RetryMax)
		}
	}
}

// TestJitterBounds: poll intervals vary by at most ±10 %.
func TestJitterBounds(t *testing.T) {
	const d = 30 * time.Second
	lo, hi := d, d
	for range 10_000 {
		j := Jitter(d)
		if j < d*9/10 || j > d*11/10 {
			t.Fatalf("Jitter(%v) = %v; want within ±10 %%", d, j)
		}
		lo, hi = min(lo, j), max(hi, j)
	}
	if hi-lo < d/10 {
		t.Errorf("Jitter(%v) stayed within [%v, %v]: hardly any jitter", d, lo, hi)
	}
}

// TestSleep: Sleep waits the whole duration, or returns false at once when
// its context ends (in a synctest bubble, with a fake clock).
func TestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if !Sleep(context.Background(), time.Hour) || time.Since(start) != time.Hour {
			t.Errorf("Sleep(1h) returned after %v", time.Since(start))
		}
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(time.Minute, cancel)
		start = time.Now()
		if Sleep(ctx, time.Hour) || time.Since(start) != time.Minute {
			t.Errorf("Sleep with a context cancelled after 1m returned after %v", time.Since(start))
		}
	})
}
