package privsep

import (
	"testing"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
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

// TestRemoteBudget: what max_total_size leaves for a mount's next payload
// is the bound less every other mount's payload held — its own is
// replaced —, kept as payloads are replaced and mounts leave.
func TestRemoteBudget(t *testing.T) {
	r := NewRemote()
	mount := func(name string) *config.Mount {
		return &config.Mount{Name: name, UID: -1, GID: -1, Projections: []config.Projection{{Source: "main"}}}
	}
	payload := func(name string, sizes ...int) {
		t.Helper()
		files := projector.Payload{}
		for i, n := range sizes {
			files[string(rune('a'+i))] = projector.File{Data: make([]byte, n), Mode: 0o644}
		}
		r.HandleMessage("main", &MountState{Mount: name, Generation: 1, Revision: "main@1"})
		r.HandlePayload("main", &Payload{Mount: name, Revision: "main@1", Files: files})
	}
	want := func(mount string, n int64) {
		t.Helper()
		if got := r.Budget(mount); got != n {
			t.Errorf("Budget(%q) = %d; want %d", mount, got, n)
		}
	}
	if err := r.SetMounts([]*config.Mount{mount("a"), mount("b"), mount("c")}); err != nil {
		t.Fatal(err)
	}
	want("a", -1) // no max_total_size
	r.SetMaxTotal(1000)
	want("a", 1000)
	payload("a", 100, 200)
	payload("b", 400)
	want("a", 600)
	want("b", 700)
	want("c", 300)
	payload("a", 50) // replaced: 300 bytes are now 50
	want("c", 550)
	want("a", 600)
	payload("b", 600, 500) // held past the bound: nothing is left
	want("c", 0)
	want("b", 950)
	if err := r.SetMounts([]*config.Mount{mount("a"), mount("c")}); err != nil { // b leaves
		t.Fatal(err)
	}
	want("c", 950)
	want("nobody", 950)
}

// TestRemoteHoldsOneCopy: a payload sent again equal to the one desired —
// as a worker started again sends every mount's — keeps its generation,
// and the Remote holds the one copy the desired state points to, not the
// new one beside it.
func TestRemoteHoldsOneCopy(t *testing.T) {
	r := NewRemote()
	mount := &config.Mount{Name: "app", UID: -1, GID: -1, Projections: []config.Projection{{Source: "main"}}}
	if err := r.SetMounts([]*config.Mount{mount}); err != nil {
		t.Fatal(err)
	}
	send := func(gen uint64, value string) *reconcile.DesiredMount {
		t.Helper()
		r.HandleMessage("main", &MountState{Mount: "app", Generation: gen, Revision: "main@7"})
		r.HandlePayload("main", &Payload{Mount: "app", Revision: "main@7", Files: projector.Payload{"k": {Data: []byte(value), Mode: 0o644}}})
		return r.Populate()["app"]
	}
	first := send(1, "v")
	again := send(1, "v") // the worker started again: its generations start again too
	if again.Generation != first.Generation {
		t.Errorf("generation %d after an equal payload; want %d kept", again.Generation, first.Generation)
	}
	held := r.mounts["app"].payload
	if &held["k"].Data[0] != &first.Payload["k"].Data[0] || &again.Payload["k"].Data[0] != &first.Payload["k"].Data[0] {
		t.Error("an equal payload sent again is held beside the one desired; want one copy")
	}
	changed := send(2, "w")
	if changed.Generation == first.Generation || string(r.mounts["app"].payload["k"].Data) != "w" || &changed.Payload["k"].Data[0] != &r.mounts["app"].payload["k"].Data[0] {
		t.Errorf("a changed payload: generation %d, held %q; want a new generation and the new payload held once", changed.Generation, r.mounts["app"].payload["k"].Data)
	}
}
