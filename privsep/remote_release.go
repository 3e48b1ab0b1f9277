package privsep

import (
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
)

// The payloads a Remote does not hold (reconcile.Releaser): one released
// once written, asked of its worker again when the reconciler needs it
// (Fetch, a Resend), and one a worker need not send at all because the
// mount holds it on disk already — the monitor gives the worker the
// digest (OnDisk), the worker answers with it (Unchanged), and the
// reconciler keeps the version (Kept).

// Release implements reconcile.Releaser: it drops mount's payload of
// generation, which the reconciler has written (or found on disk), so
// that the monitor does not hold at rest what the worker holds already —
// the snapshots it was built from; 17–18 MB of the monitor's heap at
// 1,000 mounts of 100 keys. Its digest stays, so that a payload sent
// again that is equal keeps the generation and rewrites nothing: digest
// is the one the atomic writer read from the version's manifest
// (computed here when ""), so that a restart of 1,000 mounts hashes no
// payload twice. The desired mount stays ready (reconcile.DesiredMount
// Released) until Fetch has the payload sent again. It reports whether
// it dropped it: not for an immutable mount (its worker stops following
// it once it is projected, and could not build it again), nor while a
// newer payload is to be taken (the next Populate), nor for another
// generation than the one desired. A report without a payload that came
// meanwhile (a source's health) does not keep it: at the cold start of
// 1,000 mounts, 80 or so payloads stayed held so until their next write.
func (r *Remote) Release(mount string, generation uint64, digest string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	rm := r.mounts[mount]
	if rm == nil || rm.spec.Immutable || rm.payloadNew || rm.desired == nil || rm.desired.Generation != generation || rm.desired.Payload == nil {
		return false
	}
	if digest == "" {
		digest = rm.desired.Payload.Digest()
	}
	rm.digest, rm.released, rm.asked = digest, true, time.Time{}
	rm.payload = nil
	d := *rm.desired
	d.Payload, d.Released, d.Digest = nil, true, digest
	rm.desired = &d
	if r.dsw != nil {
		r.dsw[mount] = rm.desired
	}
	return true
}

// Fetch implements reconcile.Releaser: it asks the worker of mount's
// domain for the payload Release dropped (a Resend), unless it asked
// within fetchAgain; the payload comes as any other (HandlePayload). It
// returns when to ask again if the payload has not come by then, or the
// zero time when there is nothing to ask (the payload is not released,
// or no worker can be asked).
func (r *Remote) Fetch(mount string, now time.Time) time.Time {
	r.mu.Lock()
	rm := r.mounts[mount]
	if rm == nil || !rm.released || r.send == nil {
		r.mu.Unlock()
		return time.Time{}
	}
	if next := rm.asked.Add(fetchAgain); !rm.asked.IsZero() && now.Before(next) {
		r.mu.Unlock()
		return next
	}
	rm.asked = now
	rm.onDisk = "" // the worker drops it at a Resend too
	domain, send := rm.domain, r.send
	r.mu.Unlock()
	send(domain, &Resend{Mount: mount})
	return now.Add(fetchAgain)
}

// SetSend makes f how the Remote sends messages to domain's worker: a
// Resend when Fetch asks for a payload again, the digests on disk
// (OnDisk). The Monitor's queues them to that worker, if one runs, and
// reports whether one does; f must not block.
func (r *Remote) SetSend(f func(domain string, msgs ...Message) bool) {
	r.mu.Lock()
	r.send = f
	r.mu.Unlock()
}

// OnDisk implements reconcile.Releaser: digests are the digests of what
// the owned mounts hold on disk, from their manifests, by mount. Each
// mount's is given to its domain's worker (an OnDisk message, now to a
// worker that runs, else at its start: StartMessages), so that a payload
// equal to it comes as an Unchanged, not whole. A mount not configured,
// or whose payload has come already, is left out.
func (r *Remote) OnDisk(digests map[string]string) {
	r.mu.Lock()
	byDomain := map[string][]Message{}
	for name, digest := range digests {
		rm := r.mounts[name]
		if rm == nil || rm.payload != nil || rm.released || len(digest) > MaxDigestLen {
			continue
		}
		rm.onDisk = digest
		byDomain[rm.domain] = append(byDomain[rm.domain], onDisk(name, rm, digest))
	}
	send := r.send
	r.mu.Unlock()
	if send == nil {
		return
	}
	for domain, msgs := range byDomain {
		send(domain, msgs...)
	}
}

// StartMessages returns what a worker of domain is sent when it starts,
// after its configuration: an OnDisk for each of its mounts whose digest
// on disk is known — given by OnDisk, or the payload released once
// written (Release) — so that a worker started again sends no payload
// that the mounts hold already.
func (r *Remote) StartMessages(domain string) []Message {
	r.mu.Lock()
	defer r.mu.Unlock()
	var msgs []Message
	for name, rm := range r.mounts {
		if rm.domain != domain {
			continue
		}
		if rm.onDisk == "" && rm.released && rm.payload == nil {
			rm.onDisk = rm.digest
		}
		if rm.onDisk != "" && len(rm.onDisk) <= MaxDigestLen {
			msgs = append(msgs, onDisk(name, rm, rm.onDisk))
		}
	}
	return msgs
}

// HandleUnchanged takes m, the word of domain's worker that the payload
// of its last MountState of the mount is the one on disk, and reports
// whether it took it: only for a mount of domain, at the digest the
// worker was given (OnDisk), once, for the generation of that
// MountState. The mount's desired state is then that payload, released
// at that digest, which the reconciler keeps without its bytes; a worker
// so keeps a mount at what the monitor itself wrote, and nothing else.
// Anything else is dropped and the payload asked for whole (a Resend, at
// most every fetchAgain): the mount waits for it, its content kept.
func (r *Remote) HandleUnchanged(domain string, m *Unchanged) bool {
	r.mu.Lock()
	rm := r.mounts[m.Mount]
	if rm == nil || rm.domain != domain {
		r.mu.Unlock()
		return false
	}
	if rm.state == nil || rm.state.Generation != m.Generation || rm.onDisk == "" || rm.onDisk != m.Digest {
		now, send := time.Now(), r.send
		ask := send != nil && (rm.asked.IsZero() || now.Sub(rm.asked) >= fetchAgain)
		if ask {
			rm.asked = now
		}
		r.mu.Unlock()
		if ask {
			send(domain, &Resend{Mount: m.Mount})
		}
		return false
	}
	defer r.mu.Unlock()
	// The size claimed weighs in max_total_size (Budget) as a payload's
	// would, and no more than one could: within the mount's effective
	// size and what max_total_size leaves it.
	size := int64(min(m.Size, uint64(1)<<62))
	if limit := rm.spec.EffectiveMaxSize(); limit > 0 {
		size = min(size, limit)
	}
	if r.maxTotal > 0 {
		size = min(size, max(r.maxTotal-r.held+rm.size, 0))
	}
	r.held += size - rm.size
	rm.payload, rm.size, rm.revision, rm.payloadGen, rm.payloadNew = nil, size, rm.state.Revision, m.Generation, true
	rm.onDisk, rm.kept, rm.digest = "", true, m.Digest
	r.touch(rm)
	return true
}

// Kept implements reconcile.Releaser: the version on disk was kept as the
// payload of mount's generation, taken as an Unchanged, and its files
// hold bytes, by the version's manifest. That measure replaces the size
// the worker claimed in what counts against max_total_size (Budget): a
// worker that claimed less frees no room for other payloads once the
// mount is kept.
func (r *Remote) Kept(mount string, generation uint64, bytes int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rm := r.mounts[mount]
	if rm == nil || !rm.kept || rm.desired == nil || rm.desired.Generation != generation || bytes < 0 {
		return
	}
	r.held += bytes - rm.size
	rm.size = bytes
}

// configure sets into out each file of files with owner uid and gid and
// the mode the configuration of mount spec gives it
// (config.Mount.FileModes); out may be files.
func configure(spec *config.Mount, uid, gid int, files, out projector.Payload) {
	modeOf := spec.FileModes()
	for name, f := range files {
		f.UID, f.GID, f.Mode = uid, gid, modeOf(name)
		out[name] = f
	}
}

// ConfiguredDigest returns the digest (projector.Payload.Digest) of
// payload as the monitor takes it for mount spec — with the owner the
// monitor gives its files (uid and gid, OnDisk's) and the modes the
// configuration gives (HandlePayload), whatever payload carries —,
// leaving payload as it is: what a worker compares with a digest on disk
// (OnDisk) before it sends an Unchanged in place of the payload.
func ConfiguredDigest(spec *config.Mount, uid, gid int, payload projector.Payload) string {
	out := make(projector.Payload, len(payload))
	configure(spec, uid, gid, payload, out)
	return out.Digest()
}

// onDisk returns the OnDisk message of rm, whose digest on disk is
// digest.
func onDisk(name string, rm *remoteMount, digest string) *OnDisk {
	uid, gid := reconcile.MountOwner(rm.spec)
	return &OnDisk{Mount: name, Digest: digest, UID: uint32(uid), GID: uint32(gid)}
}
