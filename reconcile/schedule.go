package reconcile

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/projector"
)

// Which operations run, and how many at once. An operation is mostly file
// system work, and a thousand at once — a cold start or a restart of 1,000
// mounts — starve everything else of the CPUs: measured on two, the
// sources' reads timed out after 10 s, and the update of one mount waited
// behind the adoption of all the others. So operations run in four
// classes, each started in the order of the mounts' names:
//
//   - a change: the remount of a projected mount whose payload moved on,
//     or the first write of a mount whose content on disk (its manifest's
//     digest, read at start) differs from its payload. It may take any
//     free slot of MaxOperations.
//   - a setup: the first write of a mount with nothing of kvmount's on
//     disk. Up to MaxSetups run at once, beside the other classes: their
//     time goes to waiting for fsyncs, and a disk finishes 100,000 of them
//     sooner the more are in flight.
//   - bulk work: adopting what a previous run left, tear-downs,
//     collections, repairs. It uses at most MaxOperations - 1 slots: one
//     is always free for a change, which therefore never waits behind
//     another mount.
//   - background verification (resync): one at a time, only while no bulk
//     work waits, and paced to a quarter of the time (after a verify that
//     took d, the next starts no sooner than 3d later), so that reading
//     100,000 files back does not compete with updates.
//
// At start, setups, bulk work and verification wait until every mount's
// first snapshot has arrived (or its source has failed), for at most
// firstReadsWait: adoption uses the CPUs that the sources' reads need, and
// a mount can be recognised as changed only once it has been read. So the
// reads end sooner, and every change found starts before any other work.
//
// 32 was measured (BENCHMARKS.md, "Restart at scale"): on two CPUs with
// 1,000 mounts no source read timed out, where 256 saw 1,518 time out;
// fewer than 16 leave the disk idle between fsyncs.
const MaxOperations = 32

// MaxSetups is how many setups run at once at most, after the first reads
// (see MaxOperations). Each holds up to projector.MaxOpenFiles files open
// and as many threads blocked in fsync, so setupLimit lowers it to fit the
// open-file limit (RLIMIT_NOFILE), and 512 keeps the threads well under
// Go's default limit of 10,000 (runtime/debug.SetMaxThreads). Measured with
// 1,000 new mounts of 100 files (BENCHMARKS.md): a cold start took 29–36 s
// with 31 at once, 21–25 s with 512 to 1,000.
const MaxSetups = 512

// reservedFiles is how many of the open-file limit setupLimit leaves for
// everything but writes: connections, watches, the admin endpoint.
const reservedFiles = 1024

// setupLimit returns how many setups run at once: MaxSetups, or fewer when
// the soft limit on open files (RLIMIT_NOFILE's, which Go raises to the hard
// one at start; 0 if unknown) leaves room for fewer beside reservedFiles and
// one handle for each of writers, but never fewer than MaxOperations - 1.
func setupLimit(soft uint64, writers int) int {
	used := uint64(reservedFiles + writers)
	if soft == 0 {
		return MaxOperations - 1
	}
	budget := MaxSetups
	if room := (soft - min(soft, used)) / projector.MaxOpenFiles; room < uint64(budget) {
		budget = int(room)
	}
	return max(budget, MaxOperations-1)
}

// openFileLimit returns the soft limit on open files, or 0 if it cannot
// be read.
func openFileLimit() uint64 {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0
	}
	return rl.Cur
}

// opClass is an operation's class, in the order they are started.
type opClass int

const (
	classChange opClass = iota
	classSetup
	classBulk
	classBackground
)

// firstReadsWait bounds how long, after Run starts, setups, bulk work and
// verification wait for the sources' first reads.
const firstReadsWait = 3 * time.Second

// holdForFirstReads reports whether setups, bulk work and verification
// wait at now for the sources' first reads: until no mount waits for a
// first snapshot from a source that has not failed, and then until the
// changes those reads found are written (while this pass may start a
// change, as changes says, or a running operation is one) — or until
// firstReadsWait after Run started. Once it has returned false, it always
// does.
//
// The changes go first in the CPUs as well as in the slots: a restart is
// CPU-bound, and 31 adoptions of unchanged mounts released with the last
// read delayed the write of the mount that read found changed by tens of
// milliseconds (BENCHMARKS.md, "A restart's changes before its
// adoptions").
func (r *Reconciler) holdForFirstReads(dsw DesiredState, now time.Time, changes bool) bool {
	if r.readsDone {
		return false
	}
	if now.Before(r.startedAt.Add(firstReadsWait)) {
		for _, d := range dsw {
			if len(d.Waiting) > 0 && len(d.Stale) == 0 {
				return true
			}
		}
		if changes {
			return true
		}
		for _, c := range r.running {
			if c == classChange {
				return true
			}
		}
	}
	r.readsDone = true
	r.log.Debug("first reads done; setups and adoption start", "after", now.Sub(r.startedAt).Round(time.Millisecond))
	return false
}

// verifyPace is how many times its own duration a verify waits before
// the next one starts.
const verifyPace = 3

// classify returns op's class.
func (r *Reconciler) classify(op Op, d *DesiredMount, a *ActualMount) opClass {
	switch op.Kind {
	case Verify:
		return classBackground
	case Setup:
		return classSetup
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
	if d.Payload == nil {
		return d.Digest // released: the Desired's word for it
	}
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
// now, changes first, within the free slots; and when a pass is due for
// work held back — a verification by its pace, anything by the first
// reads — (zero if none is).
func (r *Reconciler) schedule(ops []Op, dsw DesiredState, now time.Time) (start []Op, verifyAt time.Time) {
	// Each op's class, by index: a pass during a restart classifies
	// 1,000 held operations, and a map of them, sorted through it, was a
	// third of the pass (BenchmarkPassRestart).
	classes := make([]opClass, len(ops))
	var changes bool
	for i, op := range ops {
		classes[i] = r.classify(op, dsw[op.Mount], r.asw.Mounts[op.Mount])
		changes = changes || classes[i] == classChange
	}
	var running [4]int
	for _, c := range r.running {
		running[c]++
	}
	hold := r.holdForFirstReads(dsw, now, changes)
	maxSetups := setupLimit(r.openFiles, len(r.runtimes))
	if hold {
		verifyAt = r.startedAt.Add(firstReadsWait)
	}
	bulkWaiting := false
	// Class by class, each in the order of ops.
	for c := range opClass(len(running)) {
		for i, op := range ops {
			if classes[i] != c {
				continue
			}
			total := running[classChange] + running[classBulk] + running[classBackground]
			switch c {
			case classChange:
				if total >= MaxOperations {
					continue
				}
			case classSetup:
				if hold || running[classSetup] >= maxSetups {
					bulkWaiting = true
					continue
				}
			case classBulk:
				if hold || running[classBulk]+running[classBackground] >= MaxOperations-1 {
					bulkWaiting = true
					continue
				}
			case classBackground:
				if hold || bulkWaiting || running[classBackground] > 0 || running[classBulk]+running[classBackground] >= MaxOperations-1 {
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
	}
	r.procs.fit(running[classSetup])
	return start, verifyAt
}

// finished records that mount's operation, which took took, has ended.
func (r *Reconciler) finished(mount string, took time.Duration, now time.Time) {
	if r.running[mount] == classBackground {
		r.verifyAt = now.Add(verifyPace * took)
	}
	delete(r.running, mount)
}
