package privsep

import (
	"errors"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

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

// TestRemoteReleasesWrittenPayload: a payload written (Release) is no
// longer held, while the mount stays ready at its generation; an equal
// one sent again unasked (a worker started again) is dropped; Fetch asks
// its worker for it again, at most once per fetchAgain; the payload sent
// again, if equal, keeps the generation (nothing to rewrite but drift),
// and a changed one makes a new one. An immutable mount's payload is
// kept: its worker could not build it again.
func TestRemoteReleasesWrittenPayload(t *testing.T) {
	r := NewRemote()
	var asked []string
	r.SetSend(func(domain string, msgs ...Message) bool {
		for _, m := range msgs {
			asked = append(asked, domain+"/"+m.(*Resend).Mount)
		}
		return true
	})
	mount := &config.Mount{Name: "app", UID: -1, GID: -1, Projections: []config.Projection{{Source: "main"}}}
	frozen := &config.Mount{Name: "frozen", UID: -1, GID: -1, Immutable: true, Projections: []config.Projection{{Source: "main"}}}
	if err := r.SetMounts([]*config.Mount{mount, frozen}); err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{}, 1)
	send := func(name string, gen uint64, value string) *reconcile.DesiredMount {
		t.Helper()
		data := []byte(value)
		runtime.AddCleanup(&data[0], func(ch chan struct{}) {
			select {
			case ch <- struct{}{}:
			default:
			}
		}, released)
		r.HandleMessage("main", &MountState{Mount: name, Generation: gen, Revision: "main@7"})
		r.HandlePayload("main", &Payload{Mount: name, Revision: "main@7", Files: projector.Payload{"k": {Data: data, Mode: 0o644}}})
		return r.Populate()[name]
	}
	first := send("app", 1, "v")
	gen := first.Generation
	if r.Release("app", first.Generation+1, "") {
		t.Error("Release of a generation not desired = true")
	}
	// A report without a payload, not yet taken, does not keep it.
	r.HandleMessage("main", &MountState{Mount: "app", Generation: 1, Revision: "main@7", Stale: []string{"slow"}})
	if !r.Release("app", first.Generation, "") {
		t.Fatal("Release of the desired generation = false")
	}
	d := r.Populate()["app"]
	if d.Payload != nil || !d.Released || !d.Ready() || d.Generation != first.Generation {
		t.Fatalf("after Release: payload %v, released %v, generation %d; want none, released, ready, %d", d.Payload, d.Released, d.Generation, first.Generation)
	}
	first = nil
	for i := 0; ; i++ {
		runtime.GC()
		select {
		case <-released:
		case <-time.After(20 * time.Millisecond):
			if i < 50 {
				continue
			}
			t.Fatal("the released payload is still held after 50 collections")
		}
		break
	}
	// A report without a payload keeps it released.
	r.HandleMessage("main", &MountState{Mount: "app", Generation: 1, Revision: "main@7", Stale: []string{"down"}})
	if d := r.Populate()["app"]; !d.Released || d.Payload != nil || d.Generation != gen {
		t.Errorf("a report of the same generation: released %v, payload %v; want it released still", d.Released, d.Payload)
	}

	// An equal payload no one asked for (a worker started again) is not
	// held: nothing is to be written.
	if d := send("app", 5, "v"); d.Payload != nil || !d.Released || d.Generation != gen || r.mounts["app"].payload != nil {
		t.Errorf("an equal payload not asked for: payload %v, released %v, generation %d; want it dropped at generation %d", d.Payload, d.Released, d.Generation, gen)
	}

	now := time.Now()
	if again := r.Fetch("app", now); !again.Equal(now.Add(fetchAgain)) || len(asked) != 1 || asked[0] != "main/app" {
		t.Fatalf("Fetch = %v, asked %v; want main/app asked, again at %v", again, asked, now.Add(fetchAgain))
	}
	if again := r.Fetch("app", now.Add(time.Second)); !again.Equal(now.Add(fetchAgain)) || len(asked) != 1 {
		t.Errorf("Fetch a second later = %v, asked %v; want no second request before %v", again, asked, now.Add(fetchAgain))
	}
	if r.Fetch("app", now.Add(fetchAgain)); len(asked) != 2 {
		t.Errorf("asked %v after fetchAgain; want the worker asked again", asked)
	}
	back := send("app", 2, "v")
	if back.Payload == nil || back.Released || back.Generation != gen {
		t.Errorf("the equal payload sent again: payload %v, released %v, generation %d; want it held at generation %d", back.Payload, back.Released, back.Generation, gen)
	}
	if r.Fetch("app", now.Add(time.Hour)); len(asked) != 2 {
		t.Errorf("asked %v for a payload held; want no request", asked)
	}
	if !r.Release("app", back.Generation, "") {
		t.Fatal("Release = false")
	}
	if changed := send("app", 3, "w"); changed.Generation == gen || changed.Payload == nil {
		t.Errorf("a changed payload after Release: generation %d (was %d); want a new one", changed.Generation, gen)
	}

	f := send("frozen", 1, "x")
	if r.Release("frozen", f.Generation, "") {
		t.Error("Release of an immutable mount's payload = true; want it kept")
	}
}

// TestRemoteUnchanged: the digests on disk go to the worker of each
// mount's domain (OnDisk), and to a worker started again (StartMessages);
// an Unchanged is taken only for a mount of the reporting domain, at the
// digest given, for its last MountState's generation, and once — the
// mount is then desired released at that digest, ready without a payload
// —; anything else is dropped and the payload asked for whole (Resend),
// at most once per fetchAgain. A worker started again that finds the
// payload unchanged keeps the generation: nothing is written.
func TestRemoteUnchanged(t *testing.T) {
	r := NewRemote()
	var sent []string
	r.SetSend(func(domain string, msgs ...Message) bool {
		for _, m := range msgs {
			switch m := m.(type) {
			case *OnDisk:
				sent = append(sent, domain+" ondisk "+m.Mount+" "+m.Digest)
			case *Resend:
				sent = append(sent, domain+" resend "+m.Mount)
			}
		}
		return true
	})
	mount := func(name string) *config.Mount {
		return &config.Mount{Name: name, UID: -1, GID: -1, Projections: []config.Projection{{Source: "main"}}}
	}
	app := mount("app")
	if err := r.SetMounts([]*config.Mount{app, mount("other")}); err != nil {
		t.Fatal(err)
	}
	// The worker's modes are not the configuration's: the digest is of
	// the payload as the monitor takes it.
	files := projector.Payload{"k": {Data: []byte("v"), Mode: 0o600, UID: 7}}
	uid, gid := reconcile.MountOwner(app)
	digest := ConfiguredDigest(app, uid, gid, files)
	if files["k"].Mode != 0o600 || files["k"].UID != 7 {
		t.Fatalf("ConfiguredDigest changed the payload: %+v", files["k"])
	}
	other := strings.Repeat("0", 64)
	r.SetMaxTotal(1000)
	r.OnDisk(map[string]string{"app": digest, "other": digest, "unknown": digest})
	slices.Sort(sent)
	if want := []string{"main ondisk app " + digest, "main ondisk other " + digest}; !slices.Equal(sent, want) {
		t.Fatalf("sent %q; want %q", sent, want)
	}
	sent = nil
	refused := func(m *Unchanged, domain string) {
		t.Helper()
		if r.HandleUnchanged(domain, m) {
			t.Errorf("%+v from %s taken; want refused", m, domain)
		}
	}
	r.HandleMessage("main", &MountState{Mount: "other", Generation: 1, Revision: "main@7"})
	refused(&Unchanged{Mount: "other", Generation: 1, Digest: other}, "main")
	refused(&Unchanged{Mount: "other", Generation: 2, Digest: digest}, "main")
	if want := []string{"main resend other"}; !slices.Equal(sent, want) {
		t.Errorf("sent %q; want %q: one Resend within fetchAgain", sent, want)
	}
	r.HandleMessage("main", &MountState{Mount: "app", Generation: 1, Revision: "main@7"})
	refused(&Unchanged{Mount: "app", Generation: 1, Digest: digest}, "vault")
	refused(&Unchanged{Mount: "unknown", Generation: 1, Digest: digest}, "main")
	if !r.HandleUnchanged("main", &Unchanged{Mount: "app", Generation: 1, Digest: digest, Size: 1 << 40}) {
		t.Fatal("the Unchanged at the digest given was refused")
	}
	d := r.Populate()["app"]
	if d == nil || !d.Ready() || !d.Released || d.Payload != nil || d.Digest != digest || d.Revision != "main@7" || d.Generation == 0 {
		t.Fatalf("desired mount %+v; want released at the digest on disk, of main@7", d)
	}
	if got := r.mounts["app"].size; got != 1000 {
		t.Errorf("the size claimed is held as %d bytes; want 1000, what max_total_size leaves", got)
	}
	// Kept, the version's measure replaces the claim: a smaller one
	// frees room, a wrong generation changes nothing.
	r.Kept("app", d.Generation+1, 10)
	r.Kept("app", d.Generation, 300)
	if got, budget := r.mounts["app"].size, r.Budget("other"); got != 300 || budget != 700 {
		t.Errorf("kept: %d bytes held, %d left for another mount; want 300 and 700", got, budget)
	}
	refused(&Unchanged{Mount: "app", Generation: 1, Digest: digest}, "main")

	// A worker started again is given the digest again, and keeps the
	// generation with it.
	r.WorkerEnded("main", errors.New("killed"))
	var start []string
	for _, m := range r.StartMessages("main") {
		start = append(start, m.(*OnDisk).Mount+" "+m.(*OnDisk).Digest)
	}
	if !slices.Contains(start, "app "+digest) {
		t.Fatalf("StartMessages = %q; want app's digest", start)
	}
	r.HandleMessage("main", &MountState{Mount: "app", Generation: 1, Revision: "main@7"})
	if !r.HandleUnchanged("main", &Unchanged{Mount: "app", Generation: 1, Digest: digest}) {
		t.Fatal("the restarted worker's Unchanged was refused")
	}
	again := r.Populate()["app"]
	if !again.Released || again.Generation != d.Generation || len(again.Stale) != 0 {
		t.Errorf("after the worker's restart: %+v; want released at generation %d, not stale", again, d.Generation)
	}

	// Asked for whole (drift to repair), it comes whole, at the same
	// generation.
	sent = nil
	r.Fetch("app", time.Now())
	if want := []string{"main resend app"}; !slices.Equal(sent, want) {
		t.Fatalf("Fetch sent %q; want %q", sent, want)
	}
	r.HandleMessage("main", &MountState{Mount: "app", Generation: 2, Revision: "main@7"})
	r.HandlePayload("main", &Payload{Mount: "app", Revision: "main@7", Files: projector.Payload{"k": {Data: []byte("v"), Mode: 0o644}}})
	whole := r.Populate()["app"]
	if whole.Payload == nil || whole.Generation != d.Generation {
		t.Errorf("the payload fetched: %+v; want it held at generation %d", whole, d.Generation)
	}
}

// TestRemoteChanged: Changed says the desired state was built anew after
// SetMounts, and then names the mounts whose reports changed them, and
// only those (reconcile.ChangeReporter).
func TestRemoteChanged(t *testing.T) {
	r := NewRemote()
	mount := func(name string) *config.Mount {
		return &config.Mount{Name: name, UID: -1, GID: -1, Projections: []config.Projection{{Source: "main"}}}
	}
	if err := r.SetMounts([]*config.Mount{mount("a"), mount("b"), mount("c")}); err != nil {
		t.Fatal(err)
	}
	changed := func() (names []string, anew bool) {
		t.Helper()
		r.Populate()
		anew = !r.Changed(func(name string) { names = append(names, name) })
		slices.Sort(names)
		return names, anew
	}
	if names, anew := changed(); !anew || names != nil {
		t.Errorf("after SetMounts Changed names %v, built anew %v; want the desired state built anew", names, anew)
	}
	for _, name := range []string{"c", "a"} {
		r.HandleMessage("main", &MountState{Mount: name, Generation: 1, Revision: "main@1"})
		r.HandlePayload("main", &Payload{Mount: name, Revision: "main@1", Files: projector.Payload{"k": {Data: []byte(name), Mode: 0o644}}})
	}
	if names, anew := changed(); anew || !slices.Equal(names, []string{"a", "c"}) {
		t.Errorf("after payloads of a and c Changed names %v, built anew %v; want [a c]", names, anew)
	}
	if names, anew := changed(); anew || names != nil {
		t.Errorf("after nothing new Changed names %v, built anew %v; want none", names, anew)
	}
	if err := r.SetMounts([]*config.Mount{mount("a")}); err != nil {
		t.Fatal(err)
	}
	if _, anew := changed(); !anew {
		t.Error("after a reload that removed mounts Changed does not say the desired state was built anew")
	}
}
