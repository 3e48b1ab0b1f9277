package reconcile

import (
	"time"

	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/source"
)

// Payload builds that run off the populator's loop: a mount with templates.

// built is the result of a payload build run off the loop.
type built struct {
	payload   projector.Payload
	rejected  []*projector.KeyError
	err       error
	snapshots []*source.Snapshot
	revision  string
	changedAt time.Time
}

// buildAsync builds pm's payload from projections on a goroutine of its
// own, unless one runs already — the next Populate then starts another if
// the feeds moved on meanwhile (takeBuilt) — and calls p.wake when it
// ends. snapshots are the feed snapshots the projections come from.
func (p *Populator) buildAsync(pm *populated, projections []projector.Projection, snapshots []*source.Snapshot, revision string) {
	if pm.building {
		return
	}
	pm.building = true
	if pm.built == nil {
		pm.built = make(chan built, 1)
	}
	opts, name, changedAt, out := p.options(pm), pm.spec.Name, time.Now(), pm.built
	p.builds.Go(func() {
		payload, rejected, err := projector.MakePayload(name, projections, opts)
		out <- built{payload: payload, rejected: rejected, err: err, snapshots: snapshots, revision: revision, changedAt: changedAt}
		if p.wake != nil {
			p.wake()
		}
	})
}

// takeBuilt installs the result of pm's build off the loop, if one ended:
// a new generation of its desired mount. It reports whether it did; the
// feeds' snapshots pm.snapshots records are then those the build used, so
// that populate starts another build when they moved on meanwhile.
func (p *Populator) takeBuilt(pm *populated) bool {
	if !pm.building {
		return false
	}
	var b built
	select {
	case b = <-pm.built:
	default:
		return false
	}
	pm.building = false
	p.generation++
	d := &DesiredMount{Spec: pm.spec, Generation: p.generation, ChangedAt: b.changedAt, Revision: b.revision}
	if pm.desired != nil {
		d.Stale, d.Waiting = pm.desired.Stale, pm.desired.Waiting
	}
	p.setPayload(pm, d, b.payload, b.rejected, b.err)
	p.reportState(pm, d)
	pm.desired = d
	for i := range pm.snapshots {
		if i < len(b.snapshots) && pm.snapshots[i] != b.snapshots[i] {
			// Newer snapshots arrived during the build: build again.
			pm.snapshots[i] = b.snapshots[i]
			pm.versions[i] = 0
		}
	}
	if pm.spec.Immutable && d.Ready() {
		p.freeze(pm)
	}
	return true
}
