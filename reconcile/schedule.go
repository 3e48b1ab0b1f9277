package reconcile

import (
	"slices"
	"time"
)

// Which operations run, and how many at once. An operation is mostly file
// system work, and a thousand at once — a cold start or a restart of 1,000
// mounts — starve everything else of the CPUs: measured on two, the
// sources' reads timed out after 10 s, and the update of one mount waited
// behind the adoption of all the others. So at most MaxOperations run at
// once, in three classes, each started in the order of the mounts' names:
//
//   - a change: the remount of a projected mount whose payload moved on,
//     or the first write of a mount whose content on disk (its manifest's
//     digest, read at start) differs from its payload. It may take any
//     free slot.
//   - bulk work: setting up new mounts, adopting what a previous run
//     left, tear-downs, collections, repairs. It uses at most
//     MaxOperations - 1 slots: one is always free for a change, which
//     therefore never waits behind another mount.
//   - background verification (resync): one at a time, only while no bulk
//     work waits, and paced to a quarter of the time (after a verify that
//     took d, the next starts no sooner than 3d later), so that reading
//     100,000 files back does not compete with updates.
//
// 32 was measured (BENCHMARKS.md, "Restart at scale"): on two CPUs with
// 1,000 mounts no source read timed out, where 256 saw 1,518 time out;
// fewer than 16 leave the disk idle between fsyncs.
const MaxOperations = 32

// opClass is an operation's class, in the order they are started.
type opClass int

const (
	classChange opClass = iota
	classBulk
	classBackground
)

// verifyPace is how many times its own duration a verify waits before
// the next one starts.
const verifyPace = 3

// classify returns op's class.
func (r *Reconciler) classify(op Op, d *DesiredMount, a *ActualMount) opClass {
	switch op.Kind {
	case Verify:
		return classBackground
	case Remount:
		switch {
		case a == nil || a.RemountRequired:
			return classBulk
		case a.Generation != 0:
			return classChange
		case a.DiskDigest != "" && d != nil && r.desiredDigest(op.Mount, d) != a.DiskDigest:
			return classChange
		}
	}
	return classBulk
}

// desiredDigest returns the digest of d's payload, computed once per
// generation.
func (r *Reconciler) desiredDigest(name string, d *DesiredMount) string {
	if c, ok := r.digests[name]; ok && c.generation == d.Generation {
		return c.digest
	}
	digest := d.Payload.Digest()
	r.digests[name] = digestAt{generation: d.Generation, digest: digest}
	return digest
}

// digestAt is a desired payload's digest and its generation.
type digestAt struct {
	generation uint64
	digest     string
}

// schedule returns the operations of ops (sorted by mount name) to start
// now, changes first, within the free slots; and when a verification held
// back by its pace may start (zero if none is).
func (r *Reconciler) schedule(ops []Op, dsw DesiredState, now time.Time) (start []Op, verifyAt time.Time) {
	classes := make(map[string]opClass, len(ops))
	for _, op := range ops {
		classes[op.Mount] = r.classify(op, dsw[op.Mount], r.asw.Mounts[op.Mount])
	}
	slices.SortStableFunc(ops, func(a, b Op) int { return int(classes[a.Mount]) - int(classes[b.Mount]) })
	var running [3]int
	for _, c := range r.running {
		running[c]++
	}
	bulkWaiting := false
	for _, op := range ops {
		c := classes[op.Mount]
		total := running[classChange] + running[classBulk] + running[classBackground]
		switch c {
		case classChange:
			if total >= MaxOperations {
				continue
			}
		case classBulk:
			if running[classBulk]+running[classBackground] >= MaxOperations-1 {
				bulkWaiting = true
				continue
			}
		case classBackground:
			if bulkWaiting || running[classBackground] > 0 || running[classBulk]+running[classBackground] >= MaxOperations-1 {
				continue
			}
			if now.Before(r.verifyAt) {
				verifyAt = r.verifyAt
				continue
			}
		}
		running[c]++
		r.running[op.Mount] = c
		start = append(start, op)
	}
	return start, verifyAt
}

// finished records that mount's operation, which took took, has ended.
func (r *Reconciler) finished(mount string, took time.Duration, now time.Time) {
	if r.running[mount] == classBackground {
		r.verifyAt = now.Add(verifyPace * took)
	}
	delete(r.running, mount)
}
