package reconcile

import "time"

// A payload written is released where the Desired is a Releaser (the
// monitor's, whose worker holds the snapshots it was built from): the
// atomic writer forgets it, keeping its file count and digest, and reads
// the version's manifest again for its next write. That read is what a
// write of a mount that changes often would pay each time — within the
// noise for a mount of one key, 0.26–0.5 ms more for 100 keys (1.1–1.4
// ms), 1.6–4 ms for 1,000 (12–13 ms; one key changed, tmpfs: projector's
// BenchmarkWriteForgotten, BENCHMARKS.md) —, so a payload is released at
// once only when the mount had not been written for releaseIdle before;
// after a write that follows another within releaseIdle, it is released
// once the mount has been idle that long. A cold start, a restart, or an
// update of a mount at rest releases at once; a burst of updates pays
// for one read of the manifest at most.

// releaseIdle is how long a mount goes without a write before its payload
// is released, once it was written twice within that time: the default
// keep_replaced, so that a burst's payloads are gone before the daemon
// gives the heap back to the system after it (daemon/heap.go, 5 s
// later). Tests shorten it.
var releaseIdle = 5 * time.Second

// wrote records that generation of mount was written at now, and releases
// its payload now or once idle (see above).
func (r *Reconciler) wrote(mount string, generation uint64, now time.Time) {
	rt := r.runtimes[mount]
	if rt == nil {
		return
	}
	hot := !rt.wroteAt.IsZero() && now.Sub(rt.wroteAt) < releaseIdle
	rt.wroteAt = now
	if !rt.releaseAt.IsZero() {
		rt.releaseAt = time.Time{}
		r.releasing--
	}
	if _, ok := r.pop.(Releaser); !ok {
		return
	}
	if !hot {
		r.release(mount, generation)
		return
	}
	rt.releaseAt = now.Add(releaseIdle)
	r.releasing++
}

// releaseDue releases the payloads whose mounts have been idle for
// releaseIdle by now, and returns when the next one is due (zero: none).
// A mount with an operation in flight waits for its result.
func (r *Reconciler) releaseDue(now time.Time) (next time.Time) {
	if r.releasing == 0 {
		return time.Time{}
	}
	for mount, rt := range r.runtimes {
		switch {
		case rt.releaseAt.IsZero() || r.asw.InFlight[mount]:
		case !now.Before(rt.releaseAt):
			rt.releaseAt = time.Time{}
			r.releasing--
			if a := r.asw.Mounts[mount]; a != nil {
				r.release(mount, a.Generation)
			}
		case next.IsZero() || rt.releaseAt.Before(next):
			next = rt.releaseAt
		}
	}
	return next
}

// release has the writer of mount forget the payload of generation, its
// last written, and the Desired release it: the monitor then holds no
// payload of the mount at rest.
func (r *Reconciler) release(mount string, generation uint64) {
	rel, ok := r.pop.(Releaser)
	rt := r.runtimes[mount]
	if !ok || rt == nil || rt.writer == nil || !rt.writer.ForgetPayload() {
		return
	}
	if rel.Release(mount, generation, rt.writer.Digest()) {
		rt.written, rt.released = nil, true
	}
}
