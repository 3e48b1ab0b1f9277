package daemon

import (
	"fmt"
	"net/http"
	"testing"
	"time"
)

// TestSlowTemplateDelaysOnlyItsMount is the second review's seventh
// finding: three mounts whose template runs a 16-million-round loop (each
// render runs into its 5 s timeout) no longer hold up the reconciler's
// loop — rendering runs off it, and yields the CPU as it goes — so
// another mount's change is projected at once (165 ms after the put in one
// run without the race detector, where the loop used to wait 15 s), and
// /healthz answers meanwhile.
func TestSlowTemplateDelaysOnlyItsMount(t *testing.T) {
	h := newHarness(t)
	h.admin = "unix:" + h.path("public.sock")
	slow := "  [[mount.templates]]\n  path = \"out\"\n  text = '{{ range loop (key \"n\" | parseInt) }}{{ end }}done'\n"
	var mounts string
	for i := range 3 {
		mounts += h.mount(fmt.Sprintf("slow%d", i), fmt.Sprintf("/slow%d/", i)) + slow
	}
	h.writeConfig(mounts + h.mount("fast", "/fast/"))
	h.put("/slow0/n", "1", "/slow1/n", "1", "/slow2/n", "1", "/fast/a", "0")
	h.start()
	h.waitContent(h.path("mnt", "fast"), map[string]string{"a": "0"})
	h.waitContent(h.path("mnt", "slow0"), map[string]string{"n": "1", "out": "done"})
	h.put("/slow0/n", "16000000", "/slow1/n", "16000000", "/slow2/n", "16000000")
	time.Sleep(200 * time.Millisecond) // the renders are under way
	start := time.Now()
	h.put("/fast/a", "1")
	// In the loop, the three renders took 15 s (5 s each) before it.
	h.waitContentWithin(h.path("mnt", "fast"), map[string]string{"a": "1"}, 8*time.Second)
	t.Logf("the fast mount's change was projected %v after the put, while three renders ran", time.Since(start))
	if code, body := unixGet(t, h.path("public.sock"), "/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d %s during the slow renders", code, body)
	}
	h.waitLog("cannot build mount payload", "mount=slow0")
}
