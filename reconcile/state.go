// Package reconcile keeps mounts in step with their sources, with the
// kubelet's volume manager design: the populator builds the desired state
// of world (DSW) from the configuration and the sources' snapshots; the
// actual state of world (ASW) records what is projected on disk; Plan, a
// pure function of the two, decides the operations; the Reconciler runs
// them, one at a time per mount and never one mount waiting on another, and
// records their results in the ASW.
package reconcile

import (
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

// DesiredMount is what one mount should hold.
type DesiredMount struct {
	// Spec is the mount's configuration.
	Spec *config.Mount
	// Payload is the content to project, or nil while it cannot be built
	// or once Released.
	Payload projector.Payload
	// Released is set when the payload was built and then handed over for
	// good (Populator.ReleasePayload: a worker that sent it to the
	// monitor): the mount is ready, and Payload is nil.
	Released bool
	// Digest is a released payload's digest (projector.Payload.Digest),
	// when the Desired knows it: a mount adopted at a restart whose
	// version on disk holds that digest is taken as written without the
	// payload's bytes (projector.AtomicWriter.Keep). "" otherwise.
	Digest string
	// Generation increases whenever Payload or Spec is rebuilt.
	Generation uint64
	// ChangedAt is when this generation was built: the last change, from
	// which a mount's quiescence (wait.min) counts.
	ChangedAt time.Time
	// Revision names the snapshots Payload was built from, such as
	// "main@1042", for logs.
	Revision string
	// Err tells why Payload is nil: a missing prefix or item. Nil while
	// waiting for a source's first snapshot.
	Err error
	// Waiting names the sources whose first snapshot has not arrived.
	Waiting []string
	// Stale holds the errors of the mount's sources that cannot be read
	// now; the last content stays meanwhile.
	Stale []error
}

// Ready reports whether the mount's payload can be projected (or was
// built and released).
func (d *DesiredMount) Ready() bool { return d.Payload != nil || d.Released }

// DesiredState is the desired state of world: every configured mount by
// name.
type DesiredState map[string]*DesiredMount

// ActualMount is what kvmount has projected for one mount.
type ActualMount struct {
	// Dir is the directory the mount is projected into.
	Dir string
	// Medium is the medium it lives on.
	Medium string
	// Generation is the DSW generation last written, 0 when the content
	// was adopted from a previous run and not yet compared.
	Generation uint64
	// Version is the name of the version directory ..data points at.
	Version string
	// RemountRequired is set when the disk drifted from what was written;
	// the next remount rewrites it.
	RemountRequired bool
	// Drift is the drift a verification found and left to that remount,
	// its payload released (Releaser); nil otherwise.
	Drift error
	// VerifyDue is set by the periodic resync; a verify operation compares
	// the disk with what was written.
	VerifyDue bool
	// CollectAt is when the oldest replaced version kept for readers is
	// due for removal; zero when none is kept.
	CollectAt time.Time
	// PendingSince is when the desired payload first differed from the one
	// written, zero while they match: the start of the quiescence's
	// wait.max.
	PendingSince time.Time
	// DiskDigest is the digest of the content a previous run left, from
	// its manifest (projector.PeekDigest), while not yet adopted: a mount
	// whose payload's digest differs is adopted first (schedule.go).
	DiskDigest string
}

// Failure is the backoff state of a mount whose last operation failed.
type Failure struct {
	// Count of consecutive failures.
	Count int
	// NextRetry is the earliest time of the next attempt.
	NextRetry time.Time
	// Generation is the DSW generation the failed attempt used. When the
	// failure was the payload's own (PayloadCaused), a new generation is
	// tried at once, as its payload may fix it; a failure of the host
	// waits for NextRetry whatever arrives.
	Generation uint64
	// PayloadCaused reports that the payload itself failed: a
	// check_command veto, a path the atomic writer refused, a payload
	// over a tmpfs's size_limit (see payloadFailure). Otherwise the host
	// failed — the mount directory refused (replaced, unrecognised, a
	// symlink), EIO, ENOSPC, EACCES, a tmpfs that cannot be mounted —
	// which no new payload fixes.
	PayloadCaused bool
	// Err is the last failure.
	Err error
}

// HeldBack is a desired payload that a mount's guard rails (min_keys,
// allow_empty) kept from replacing its content.
type HeldBack struct {
	// Generation is the DSW generation held back; the next one is tried.
	Generation uint64
	// Err says why.
	Err error
}

// ActualState is the actual state of world.
type ActualState struct {
	// Mounts that are projected (or adopted from a previous run), by name.
	Mounts map[string]*ActualMount
	// Failures of the last operation, by mount name.
	Failures map[string]*Failure
	// HeldBack holds the payloads kept back by guard rails, by mount name.
	HeldBack map[string]*HeldBack
	// InFlight holds the mounts with an operation running.
	InFlight map[string]bool
}

// NewActualState returns an empty actual state of world.
func NewActualState() *ActualState {
	return &ActualState{
		Mounts:   map[string]*ActualMount{},
		Failures: map[string]*Failure{},
		HeldBack: map[string]*HeldBack{},
		InFlight: map[string]bool{},
	}
}

// Backoff limits of failing mounts: the kubelet's exponential backoff for
// volume operations (pkg/util/goroutinemap/exponentialbackoff), 500 ms
// doubling up to 2 min 2 s.
const (
	BackoffInitial = 500 * time.Millisecond
	BackoffMax     = 2*time.Minute + 2*time.Second
)

// BackoffDelay returns the wait after the n-th consecutive failure (n ≥ 1).
func BackoffDelay(n int) time.Duration {
	d := BackoffInitial
	for i := 1; i < n && d < BackoffMax; i++ {
		d *= 2
	}
	return min(d, BackoffMax)
}
