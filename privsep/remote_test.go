package privsep

import (
	"testing"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

// TestRemoteWakesAtIdle: the reports of one write — a mount's state, its
// payload, a source's state — wake the loop once, at Idle, and the next
// Populate holds them all; an Idle with nothing new wakes nobody.
func TestRemoteWakesAtIdle(t *testing.T) {
	r := NewRemote()
	wakes := 0
	r.WakeOnBuild(func() { wakes++ })
	mount := &config.Mount{Name: "app", UID: -1, GID: -1, Projections: []config.Projection{{Source: "main"}}}
	if err := r.SetMounts([]*config.Mount{mount}); err != nil {
		t.Fatal(err)
	}
	r.HandleMessage("main", &MountState{Mount: "app", Generation: 1, Revision: "main@7"})
	r.HandlePayload("main", &Payload{Mount: "app", Revision: "main@7", Files: projector.Payload{"k": {Data: []byte("v"), Mode: 0o644}}})
	r.HandleMessage("main", &State{Source: "main", Revision: "7"})
	if wakes != 0 {
		t.Fatalf("%d wake-ups before Idle", wakes)
	}
	r.Idle()
	r.Idle()
	if wakes != 1 {
		t.Errorf("%d wake-ups after two Idles; want 1", wakes)
	}
	d := r.Populate()["app"]
	if d == nil || !d.Ready() || string(d.Payload["k"].Data) != "v" || d.Revision != "main@7" {
		t.Errorf("desired mount %+v; want the payload of main@7", d)
	}
}
