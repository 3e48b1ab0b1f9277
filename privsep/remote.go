package privsep

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
	"github.com/kvmount/kvmount/source"
)

// Remote is the monitor's desired state of world (reconcile.Desired),
// built from what the workers report — their mounts' states and
// payloads, their sources' states — instead of from snapshots. It takes
// a worker's word for nothing the configuration settles: a report of a
// mount or a source that is not of the reporting worker's trust domain
// (Domains) is dropped, owners and modes come from the configuration,
// and payloads have passed the Assembler. A payload equal to the one
// desired keeps its generation, so that a restarted worker's first
// payloads rewrite nothing. Its Handle methods and Idle are called from
// the goroutines that read the workers (Supervisor's OnPayload,
// OnMessage and OnIdle); Populate from the reconciler's loop.
type Remote struct {
	mu     sync.Mutex
	mounts map[string]*remoteMount
	// sources are the domains of the sources the mounts read, by source.
	sources map[string]string
	// events wait for the next Populate, in order.
	events   []reconcile.Event
	observer reconcile.Observer
	wake     func()
	// pending is set when a report came since the last Idle.
	pending bool
	// generation numbers desired payloads; it only grows.
	generation uint64
	// dsw is the desired state Populate returns, nil until the next
	// Populate builds it whole; touched holds the mounts marked dirty
	// since the last Populate, which rebuilds only them (a walk over
	// every mount was an eighth of a pass during a restart of 1,000).
	dsw     reconcile.DesiredState
	touched []*remoteMount
	// changed are the mounts the last Populate put anew into dsw, and
	// rebuilt whether it built dsw whole instead (Changed).
	changed []string
	rebuilt bool
	// maxTotal is max_total_size: the payloads of every mount together
	// stay within it (Budget).
	maxTotal int64
	// held is the bytes of every mount's payload together (the sum of
	// their size), kept as payloads come and mounts go so that Budget,
	// asked at every payload's start, costs no walk of every mount's
	// files: 1,000 mounts of 100 keys made that walk half the monitor's
	// work after a restart.
	held int64
	// send sends msgs to domain's worker, if one runs (Fetch's Resend,
	// OnDisk's digests); nil before the Monitor sets it.
	send func(domain string, msgs ...Message) bool
}

// fetchAgain is how long Fetch waits for a payload asked of a worker
// before it asks again: a worker that ignores the request (taken over,
// or busy reading its store) is asked at most this often.
const fetchAgain = 5 * time.Second

// SetMaxTotal sets the bound of every mount's payload together, in bytes
// (max_total_size); 0 for none.
func (r *Remote) SetMaxTotal(n int64) {
	r.mu.Lock()
	r.maxTotal = n
	r.mu.Unlock()
}

// Budget returns the most bytes a new payload of mount may hold: what
// max_total_size leaves beside the payloads held of the other mounts (the
// mount's own is replaced); -1 for no bound. The Assembler refuses a
// payload that passes it while it arrives (Supervisor.Budget).
func (r *Remote) Budget(mount string) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.maxTotal <= 0 {
		return -1
	}
	left := r.maxTotal - r.held
	if rm := r.mounts[mount]; rm != nil {
		left += rm.size
	}
	return max(left, 0)
}

// WorkerEnded takes the end of the worker of domain (Supervisor's OnEnd):
// until the next one reports a mount of the domain, the mount is stale —
// its content stays, and nothing keeps it current.
func (r *Remote) WorkerEnded(domain string, why error) {
	r.mu.Lock()
	for _, rm := range r.mounts {
		if rm.domain != domain {
			continue
		}
		rm.ended = fmt.Errorf("the worker that reads its sources ended (%v); starting it again", why)
		r.touch(rm)
	}
	wake := r.wake
	r.pending = false
	r.mu.Unlock()
	if wake != nil {
		wake()
	}
}

// remoteMount is the Remote's record of one mount.
type remoteMount struct {
	spec *config.Mount
	// domain is the name of the mount's trust domain: only its worker
	// reports the mount.
	domain string
	// state is the worker's last report, nil before the first.
	state *MountState
	// payload came after the report of generation payloadGen.
	payload projector.Payload
	// size is payload's bytes (projector.Payload.Size).
	size       int64
	revision   string
	payloadGen uint64
	payloadNew bool
	desired    *reconcile.DesiredMount
	dirty      bool
	// ended is set when the worker ended, until the next one reports
	// this mount's state.
	ended error
	// released is set once the payload of the desired generation was
	// written and dropped (Release); digest is then its digest, and
	// asked when Fetch last asked the worker for it again.
	released bool
	digest   string
	asked    time.Time
	// onDisk is the digest the worker was given (OnDisk) of what the
	// mount holds on disk, until its next payload comes, whole or as an
	// Unchanged at that digest (kept, for payloadGen).
	onDisk string
	kept   bool
}

// NewRemote returns a Remote with no mounts.
func NewRemote() *Remote {
	return &Remote{mounts: map[string]*remoteMount{}, sources: map[string]string{}, observer: reconcile.ObserverFunc(func(reconcile.Event) {})}
}

// SetObserver implements reconcile.Desired. The workers may be reporting
// already.
func (r *Remote) SetObserver(o reconcile.Observer) {
	r.mu.Lock()
	r.observer = o
	r.mu.Unlock()
}

// WakeOnBuild implements reconcile.Desired: f is called at Idle when the
// worker reported something since the last one.
func (r *Remote) WakeOnBuild(f func()) {
	r.mu.Lock()
	r.wake = f
	r.mu.Unlock()
}

// SetSources implements reconcile.Desired; the worker holds the sources.
func (r *Remote) SetSources(map[string]source.Source) {}

// SetMounts implements reconcile.Desired: a mount whose configuration is
// unchanged keeps its desired state; a new or changed one waits for its
// worker's report. Each mount, and each source the mounts read, is
// reported by the worker of its trust domain (Domains) alone. It returns
// nil.
func (r *Remote) SetMounts(mounts []*config.Mount) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	next := make(map[string]*remoteMount, len(mounts))
	domainOf, sources := mountDomains(Domains(mounts, nil))
	for _, m := range mounts {
		if old, ok := r.mounts[m.Name]; ok && reflect.DeepEqual(old.spec, m) && old.domain == domainOf[m.Name] {
			next[m.Name] = old
			continue
		}
		next[m.Name] = &remoteMount{spec: m, domain: domainOf[m.Name], dirty: true}
	}
	r.held = 0
	for _, rm := range next {
		r.held += rm.size
	}
	r.mounts, r.sources, r.dsw = next, sources, nil
	return nil
}

// HandlePayload takes a payload the Assembler checked, from the worker
// of domain: it becomes its mount's desired payload at the next
// Populate, with the owners and modes the mount's configuration says
// (config.Mount.FileModes), whatever the worker sent. A payload of a
// mount not configured, or not of domain, is dropped.
func (r *Remote) HandlePayload(domain string, p *Payload) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rm := r.mounts[p.Mount]
	if rm == nil || rm.state == nil || rm.domain != domain {
		return
	}
	// Owners and modes are the configuration's: what the worker said of
	// them is not taken.
	uid, gid := reconcile.MountOwner(rm.spec)
	configure(rm.spec, uid, gid, p.Files, p.Files)
	size := p.Files.Size()
	r.held += size - rm.size
	rm.payload, rm.size, rm.revision, rm.payloadGen, rm.payloadNew = p.Files, size, p.Revision, rm.state.Generation, true
	rm.onDisk, rm.kept = "", false
	r.touch(rm)
}

// HandleMessage takes one of the reports of the worker of domain: a
// MountState, State or HeldBack. Reports of mounts and sources the
// configuration does not have or that are not of domain, and held-back
// payloads of another guard rail than the worker's five, are dropped.
func (r *Remote) HandleMessage(domain string, m Message) {
	r.mu.Lock()
	defer r.mu.Unlock()
	switch m := m.(type) {
	case *MountState:
		if rm := r.mounts[m.Mount]; rm != nil && rm.domain == domain {
			rm.state, rm.ended = m, nil
			r.touch(rm)
		}
	case *State:
		if r.sources[m.Source] != domain {
			return
		}
		ev := reconcile.SourceEvent{Source: m.Source, Revision: m.Revision, Time: time.Now()}
		if m.Err != "" {
			ev.Err = errors.New(m.Err)
		}
		r.event(ev)
	case *HeldBack:
		switch m.Guard {
		case "max_value_size", "max_mount_size", "max_files", "size_limit", "max_total_size":
		default:
			return
		}
		if rm := r.mounts[m.Mount]; rm == nil || rm.domain != domain {
			return
		}
		r.event(reconcile.HeldBackEvent{Mount: m.Mount, Guard: m.Guard, Reason: m.Reason, Revision: m.Revision, Time: time.Now()})
	}
}

// touch marks rm for the next Populate and the loop to be woken at Idle.
func (r *Remote) touch(rm *remoteMount) {
	if !rm.dirty {
		rm.dirty = true
		r.touched = append(r.touched, rm)
	}
	r.pending = true
}

// event queues ev for the next Populate and the loop to be woken at Idle.
func (r *Remote) event(ev reconcile.Event) {
	r.events = append(r.events, ev)
	r.pending = true
}

// Idle wakes the loop (WakeOnBuild) if a report was handled since the
// last call. The Supervisor calls it (Supervisor.OnIdle) once the
// messages of one write are handled: a mount's state, the payload after
// it and the sources' states wake the loop once, when all are in.
func (r *Remote) Idle() {
	r.mu.Lock()
	wake := r.pending && r.wake != nil
	r.pending = false
	f := r.wake
	r.mu.Unlock()
	if wake {
		f()
	}
}

// Populate implements reconcile.Desired: the desired state of every
// configured mount, from the worker's last reports. The events reported
// since the last call go to the observer first. The map returned is
// updated in place by the next call.
func (r *Remote) Populate() reconcile.DesiredState {
	r.mu.Lock()
	events := r.events
	r.events = nil
	r.changed, r.rebuilt = r.changed[:0], r.dsw == nil
	if r.dsw == nil {
		r.dsw = make(reconcile.DesiredState, len(r.mounts))
		for name, rm := range r.mounts {
			if rm.dirty || rm.desired == nil {
				rm.desired = r.build(rm)
				rm.dirty = false
			}
			r.dsw[name] = rm.desired
		}
	} else {
		for _, rm := range r.touched {
			// Every mount touched is one of r.mounts: SetMounts, which
			// drops mounts, clears dsw and so the walk above follows.
			if rm.dirty {
				rm.desired = r.build(rm)
				rm.dirty = false
				r.dsw[rm.spec.Name] = rm.desired
				r.changed = append(r.changed, rm.spec.Name)
			}
		}
	}
	clear(r.touched)
	r.touched = r.touched[:0]
	dsw, observer := r.dsw, r.observer
	r.mu.Unlock()
	for _, ev := range events {
		observer.Observe(ev)
	}
	return dsw
}

// Changed implements reconcile.ChangeReporter: the mounts the last
// Populate put anew into the desired state, or false when it built the
// desired state whole.
func (r *Remote) Changed(f func(name string)) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.rebuilt {
		return false
	}
	for _, name := range r.changed {
		f(name)
	}
	return true
}

// build returns rm's desired mount from the worker's last reports, stale
// while no worker reports it.
func (r *Remote) build(rm *remoteMount) *reconcile.DesiredMount {
	d := r.buildReported(rm)
	if rm.ended != nil {
		d.Stale = append(slices.Clip(d.Stale), rm.ended)
	}
	return d
}

// buildReported returns rm's desired mount from the worker's last
// reports.
func (r *Remote) buildReported(rm *remoteMount) *reconcile.DesiredMount {
	prev := rm.desired
	st := rm.state
	d := &reconcile.DesiredMount{Spec: rm.spec}
	if st == nil {
		// Nothing reported yet: waiting for every source, as the
		// populator's mounts wait for their first snapshots.
		for _, pr := range rm.spec.Projections {
			if !slices.Contains(d.Waiting, pr.Source) {
				d.Waiting = append(d.Waiting, pr.Source)
			}
		}
		return d
	}
	d.Waiting, d.Revision = st.Waiting, st.Revision
	for _, s := range st.Stale {
		d.Stale = append(d.Stale, errors.New(s))
	}
	switch {
	case len(st.Waiting) > 0 && prev != nil && prev.Ready():
		// A worker started again, whose sources have not answered yet:
		// the payload stays desired, stale meanwhile.
		d.Payload, d.Released, d.Digest, d.Generation, d.ChangedAt, d.Revision, d.Waiting = prev.Payload, prev.Released, prev.Digest, prev.Generation, prev.ChangedAt, prev.Revision, nil
		for _, w := range st.Waiting {
			d.Stale = append(d.Stale, fmt.Errorf("source %q: no snapshot yet since the worker started", w))
		}
	case len(st.Waiting) > 0:
	case st.Err != "":
		d.Err = errors.New(st.Err)
		rm.released = false
		if prev != nil && prev.Payload == nil && prev.Err != nil && prev.Err.Error() == st.Err {
			d.Generation, d.ChangedAt = prev.Generation, prev.ChangedAt
		} else {
			r.generation++
			d.Generation, d.ChangedAt = r.generation, time.Now()
		}
	case rm.kept && rm.payloadGen == st.Generation:
		// The payload on disk, by the worker's word at the digest it
		// was given (unchanged): released from the start, which the
		// reconciler keeps as it is once its adoption confirms it.
		d.Released, d.Digest, d.Revision = true, rm.digest, rm.revision
		if prev != nil && prev.Released && prev.Payload == nil && prev.Digest == rm.digest {
			d.Generation, d.ChangedAt = prev.Generation, prev.ChangedAt
		} else {
			r.generation++
			d.Generation, d.ChangedAt = r.generation, time.Now()
		}
		rm.payloadNew, rm.released, rm.asked = false, true, time.Time{}
	case rm.payload != nil && rm.payloadGen == st.Generation:
		d.Payload, d.Revision = rm.payload, rm.revision
		switch {
		case prev != nil && prev.Payload != nil && (!rm.payloadNew || prev.Payload.Equal(rm.payload)):
			d.Generation, d.ChangedAt = prev.Generation, prev.ChangedAt
			// One copy is held: the payload sent again (by a worker
			// started again, every mount's) is dropped for the equal
			// one already desired, which the reconciler may be writing.
			d.Payload, rm.payload = prev.Payload, prev.Payload
		case prev != nil && prev.Released && rm.released && rm.payload.Digest() == rm.digest:
			// The payload written and released, sent again: the same
			// generation, which rewrites nothing unless the disk
			// drifted. Asked for (Fetch), it is held until the
			// remount; sent by a worker started again, unasked, it is
			// dropped at once — nothing is to be written.
			d.Generation, d.ChangedAt = prev.Generation, prev.ChangedAt
			if rm.asked.IsZero() {
				d.Payload, d.Released, d.Digest, rm.payload, rm.payloadNew = nil, true, rm.digest, nil, false
				return d
			}
		default:
			r.generation++
			d.Generation, d.ChangedAt = r.generation, time.Now()
		}
		rm.payloadNew, rm.released, rm.asked, rm.kept = false, false, time.Time{}, false
	case prev != nil:
		// The payload of this report is on its way: what is desired
		// stays until it comes.
		d.Payload, d.Released, d.Digest, d.Err, d.Generation, d.ChangedAt, d.Revision = prev.Payload, prev.Released, prev.Digest, prev.Err, prev.Generation, prev.ChangedAt, prev.Revision
	}
	return d
}

// Mounts returns the limits of each of mounts, by name, for the
// Assembler: a payload is refused as soon as it passes its mount's
// effective size (max_mount_size, and a tmpfs's size_limit).
func Mounts(mounts []*config.Mount) map[string]MountLimits {
	out := make(map[string]MountLimits, len(mounts))
	for _, m := range mounts {
		out[m.Name] = MountLimits{MaxValueSize: m.MaxValueSize, MaxSize: m.EffectiveMaxSize(), MaxFiles: m.MaxFiles}
	}
	return out
}

var (
	_ reconcile.Desired  = (*Remote)(nil)
	_ reconcile.Releaser = (*Remote)(nil)
)
