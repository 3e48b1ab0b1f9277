package reconcile

import (
	"fmt"
	"strconv"
	"testing"

	"github.com/kvmount/kvmount/config"
)

// BenchmarkPopulateOneChange measures what one update costs the
// populator: a new snapshot of one mount's feed, then Populate, as the
// worker's loop runs it after a watch event. The other mounts' feeds do
// not change. mounts=1 is BenchmarkPutToFile's case; mounts=1000 is
// BenchmarkScale100kKeys' daemon between its restarts, where any work per
// mount that Populate does is paid a thousand times on every update.
func BenchmarkPopulateOneChange(b *testing.B) {
	for _, n := range []int{1, 1000} {
		b.Run(fmt.Sprintf("mounts=%d", n), func(b *testing.B) {
			cache := newFakeCache()
			p := NewPopulatorFor(cache, discard)
			mounts := make([]*config.Mount, n)
			for i := range n {
				prefix := fmt.Sprintf("/m%04d/", i)
				mounts[i] = testMount(fmt.Sprintf("m%04d", i), prefix)
				cache.feed("main", prefix).publish("1", map[string]string{"key": "value"})
			}
			if err := p.SetMounts(mounts); err != nil {
				b.Fatal(err)
			}
			p.Populate()
			changing := cache.feed("main", "/m0000/")
			rev := 1
			for b.Loop() {
				rev++
				changing.publish(strconv.Itoa(rev), map[string]string{"key": "value " + strconv.Itoa(rev)})
				if d := p.Populate()["m0000"]; d.Revision != "main@"+strconv.Itoa(rev) || len(d.Payload) != 1 {
					b.Fatalf("m0000 at %q with %d files, want main@%d with 1", d.Revision, len(d.Payload), rev)
				}
			}
		})
	}
}
