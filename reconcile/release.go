package reconcile

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/projector"
)

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
	rt.releaseAt = time.Time{}
	delete(r.releasing, mount)
	if _, ok := r.pop.(Releaser); !ok {
		return
	}
	if !hot {
		r.release(mount, generation)
		return
	}
	rt.releaseAt = now.Add(releaseIdle)
	r.releasing[mount] = struct{}{}
}

// releaseDue releases the payloads whose mounts have been idle for
// releaseIdle by now, and returns when the next one is due (zero: none).
// A mount with an operation in flight waits for its result. It visits the
// mounts waiting (releasing), not every mount: during a burst of updates
// of one mount among 1,000 that is one.
func (r *Reconciler) releaseDue(now time.Time) (next time.Time) {
	for mount := range r.releasing {
		rt := r.runtimes[mount]
		switch {
		case rt == nil: // torn down
			delete(r.releasing, mount)
		case r.asw.InFlight[mount]:
		case !now.Before(rt.releaseAt):
			rt.releaseAt = time.Time{}
			delete(r.releasing, mount)
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
		r.changes.mark(mount) // its desired mount is one without a payload now
		rt.written, rt.released = nil, true
	}
}

// kept tells the Desired, if it releases payloads, the bytes the version
// kept for mount's generation holds (keep): its size, measured on disk,
// is what counts against max_total_size from then on.
func (r *Reconciler) kept(mount string, generation uint64, bytes int64) {
	if rel, ok := r.pop.(Releaser); ok {
		rel.Kept(mount, generation, bytes)
	}
}

// A restart's payloads need not cross at all where the version on disk
// holds them: the Desired (Releaser) is told each owned mount's digest
// from its manifest's head (Releaser.OnDisk), and a payload found equal
// comes as released at that digest. keep then takes the version as
// written once the adoption has matched its manifest against the disk
// (one fstat per file), and its bytes are read back by the background
// verification, as after any adoption from a manifest.

// keepable reports whether d, released, can be kept without its payload
// (keep): the mount is as a previous run left it — adopted at the start,
// no generation written by this run, not found drifted — and its
// manifest's head records the digest the Desired gives.
func keepable(d *DesiredMount, a *ActualMount) bool {
	return d.Released && d.Payload == nil && d.Digest != "" && a != nil && a.Generation == 0 && !a.RemountRequired && a.DiskDigest == d.Digest
}

// keep takes mount name's version on disk as the projection of the
// released payload of digest, opening (and adopting) its directory first
// if needed, and returns the files and bytes it holds. The guard rails
// that weigh a payload by its files (min_keys) apply as to a write of it.
// It returns an error wrapping projector.ErrNotKept when the version is
// not known to hold that payload — the adoption found drift, or another
// digest — or holds more files or bytes than the mount's max_files and
// effective size allow now (the configuration lowered them since the
// version was written): the payload is then
// fetched and written (pass), meeting every guard rail as a payload does.
func (r *Reconciler) keep(name string, spec *config.Mount, rt *runtime, digest string) (files int, bytes int64, err error) {
	if rt.writer == nil {
		if err := r.open(name, spec, rt); err != nil {
			return 0, 0, err
		}
	}
	files, bytes = rt.writer.Files(), rt.writer.Size()
	if limit := spec.EffectiveMaxSize(); bytes < 0 || (spec.MaxFiles > 0 && files > spec.MaxFiles) || (limit > 0 && bytes > limit) {
		return 0, 0, fmt.Errorf("mount %q: %d files of %d bytes against max_files %d and a size of %d: %w", name, files, bytes, spec.MaxFiles, limit, projector.ErrNotKept)
	}
	if err := holdBack(spec, files, files); err != nil {
		return 0, 0, err
	}
	if err := rt.writer.Keep(digest); err != nil {
		if errors.Is(err, fsutil.ErrReplaced) {
			// As project: the next attempt opens it anew.
			rt.writer.Close()
			rt.writer = nil
		}
		return 0, 0, fmt.Errorf("mount %q: %w", name, err)
	}
	rt.written, rt.released = nil, true
	return files, bytes, nil
}
