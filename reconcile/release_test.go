package reconcile

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
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

func (p *releasing) Kept(string, uint64, int64) {}

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

// keeping is a Releaser over a Populator that, told the digests of what
// the mounts hold on disk (OnDisk), gives a mount whose payload has that
// digest as released at it, without the payload, as the monitor's Remote
// does for a worker's Unchanged — or, lying, gives every such mount so,
// whatever its payload, as a hostile worker could. A Fetch has the
// payload given whole from then on.
type keeping struct {
	*Populator
	lie bool

	mu      sync.Mutex
	onDisk  map[string]string
	whole   map[string]bool
	kept    []string
	fetched int
}

func (k *keeping) Populate() DesiredState {
	dsw := k.Populator.Populate()
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make(DesiredState, len(dsw))
	for name, d := range dsw {
		out[name] = d
		digest := k.onDisk[name]
		switch {
		case d == nil || digest == "" || k.whole[name]:
		case k.lie:
			out[name] = &DesiredMount{Spec: d.Spec, Released: true, Digest: digest, Generation: 1, Revision: "lie"}
		case d.Payload != nil && d.Payload.Digest() == digest:
			out[name] = &DesiredMount{Spec: d.Spec, Released: true, Digest: digest, Generation: d.Generation, ChangedAt: d.ChangedAt, Revision: d.Revision}
		}
	}
	return out
}

func (k *keeping) Release(string, uint64, string) bool { return false }

func (k *keeping) Fetch(mount string, now time.Time) time.Time {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.fetched++
	k.whole[mount] = true
	return now.Add(100 * time.Millisecond)
}

func (k *keeping) OnDisk(digests map[string]string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.onDisk = digests
}

func (k *keeping) Kept(mount string, generation uint64, bytes int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.kept = append(k.kept, fmt.Sprintf("%s gen=%d bytes=%d", mount, generation, bytes))
}

func (k *keeping) counts() (kept []string, fetched int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.kept), k.fetched
}

// TestRestartKeepsTheVersionOnDisk: after a restart, a mount whose
// payload comes released at the digest its manifest records is kept as
// it is — the same version, the same inodes, the Desired told the bytes
// the version holds — and written as ever at its next change. A Desired
// that gives a mount so when the version holds more files than max_files
// now allows is refused, and the payload asked for whole: a keep passes
// the guard rails a write of it would.
func TestRestartKeepsTheVersionOnDisk(t *testing.T) {
	base := t.TempDir()
	m := testMount("m", "/m/")
	first := startReconcilerIn(t, base, nil, time.Hour, m)
	first.publish("/m/", map[string]string{"a": "1", "b": "22"})
	first.wait("m", "projected", projected)
	version, err := os.Readlink(filepath.Join(m.Dir, "..data"))
	if err != nil {
		t.Fatal(err)
	}
	before, err := os.Stat(filepath.Join(m.Dir, "a"))
	if err != nil {
		t.Fatal(err)
	}
	first.stop()

	k := &keeping{whole: map[string]bool{}}
	second := startReconcilerIn(t, base, func(p *Populator) Desired { k.Populator = p; return k }, time.Hour, m)
	second.publish("/m/", map[string]string{"a": "1", "b": "22"})
	second.wait("m", "projected", projected)
	if kept, fetched := k.counts(); len(kept) != 1 || !strings.HasSuffix(kept[0], "bytes=3") || fetched != 0 {
		t.Errorf("kept %q, fetched %d times; want m kept once at 3 bytes, nothing fetched", kept, fetched)
	}
	if now, _ := os.Readlink(filepath.Join(m.Dir, "..data")); now != version {
		t.Errorf("..data is %s after the restart; want %s kept", now, version)
	}
	if after, err := os.Stat(filepath.Join(m.Dir, "a")); err != nil || !os.SameFile(before, after) {
		t.Errorf("a was written again (%v)", err)
	}
	second.publish("/m/", map[string]string{"a": "2", "b": "22"})
	deadline := time.Now().Add(10 * time.Second)
	for second.read("m", "a") != "2" {
		if time.Now().After(deadline) {
			t.Fatal("the change after the restart was never written")
		}
		time.Sleep(2 * time.Millisecond)
	}
	second.stop()

	m.MaxFiles = 1
	liar := &keeping{whole: map[string]bool{}, lie: true}
	third := startReconcilerIn(t, base, func(p *Populator) Desired { liar.Populator = p; return liar }, time.Hour, m)
	third.publish("/m/", map[string]string{"a": "2", "b": "22"})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		if _, fetched := liar.counts(); fetched > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the payload was never asked for whole")
		}
	}
	if kept, _ := liar.counts(); len(kept) != 0 {
		t.Errorf("kept %q: 2 files over max_files = 1", kept)
	}
	if got := third.read("m", "a") + third.read("m", "b"); got != "222" {
		t.Errorf("the mount holds %q; want its content kept", got)
	}
}
