package reconcile

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// releasing is a Populator that releases payloads and builds them again
// when fetched, as the monitor's Remote does with its worker, and counts
// both.
type releasing struct {
	*Populator
	mu       sync.Mutex
	released []uint64
	fetched  int
	withhold bool
}

func (p *releasing) Release(mount string, generation uint64, digest string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if digest == "" {
		panic("Release without the writer's digest")
	}
	p.released = append(p.released, generation)
	p.ReleasePayload(mount)
	return true
}

func (p *releasing) Fetch(mount string, now time.Time) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fetched++
	if !p.withhold {
		p.Rebuild(mount)
	}
	return now.Add(100 * time.Millisecond)
}

func (p *releasing) OnDisk(map[string]string) {}

func (p *releasing) counts() (released, fetched int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.released), p.fetched
}

// TestPayloadReleasedOnceWritten: a Releaser's payload is released right
// after a mount's first write, and after a write that follows another
// within releaseIdle only once the mount has been idle that long — the
// last one's, the others' never (so a burst of updates reads the
// version's manifest again once at most).
// Drift found once it is released is left for a remount: the mount is
// stale, saying so, until the payload fetched comes, and is then put
// back.
func TestPayloadReleasedOnceWritten(t *testing.T) {
	defer func(d time.Duration) { releaseIdle = d }(releaseIdle)
	releaseIdle = time.Second
	var pop *releasing
	r := startReconcilerWith(t, func(p *Populator) Desired {
		pop = &releasing{Populator: p, withhold: true}
		return pop
	}, 200*time.Millisecond, testMount("m", "/m/"))
	released := func(want int, within time.Duration) {
		t.Helper()
		deadline := time.Now().Add(within)
		for n, _ := pop.counts(); n != want; n, _ = pop.counts() {
			if time.Now().After(deadline) {
				t.Fatalf("%d payloads released; want %d within %v", n, want, within)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	r.publish("/m/", map[string]string{"a": "1"})
	r.wait("m", "projected", projected)
	released(1, time.Second)
	r.publish("/m/", map[string]string{"a": "2"})
	r.wait("m", "holding 2", func(MountStatus) bool { return r.read("m", "a") == "2" })
	r.publish("/m/", map[string]string{"a": "3"})
	r.wait("m", "holding 3", func(MountStatus) bool { return r.read("m", "a") == "3" })
	if n, _ := pop.counts(); n != 1 {
		t.Errorf("%d payloads released right after a burst; want 1 (the first write's): the burst's kept until the mount is idle", n)
	}
	released(2, 5*time.Second) // the last write's, once idle

	if err := os.WriteFile(filepath.Join(r.base, "mnt", "m", "..data", "a"), []byte("X"), 0o644); err != nil {
		t.Fatal(err)
	}
	r.wait("m", "stale, its payload asked for", func(st MountStatus) bool {
		for _, err := range st.Stale {
			if strings.Contains(err.Error(), "the payload is asked for again") {
				return true
			}
		}
		return false
	})
	if _, fetched := pop.counts(); fetched == 0 || r.read("m", "a") != "X" {
		t.Fatalf("fetched %d times, the file holds %q; want the payload asked for and the drift left", fetched, r.read("m", "a"))
	}
	pop.mu.Lock()
	pop.withhold = false
	pop.mu.Unlock()
	r.wait("m", "repaired", func(st MountStatus) bool { return st.Projected && len(st.Stale) == 0 && r.read("m", "a") == "3" })
}
