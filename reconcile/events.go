package reconcile

import (
	"time"

	"github.com/kvmount/kvmount/projector"
)

// Observer receives the reconciler's events: one stream from which
// metrics, the admin endpoint's status, systemd's STATUS= line and the
// notifier are fed; the reconciler imports none of them. Observe is called
// on the reconciler's loop goroutine, in order, and must not block: an
// observer with slow work hands it to a goroutine of its own.
type Observer interface {
	Observe(Event)
}

// Event is one of the *Event types of this package.
type Event interface{ isEvent() }

// ProjectedEvent: a mount holds its desired payload after a setup or
// remount. An empty Change means nothing had to be written — a mount adopted
// unchanged at start, or a write whose payload equalled the disk; only a
// non-empty one is a switch to a new version.
type ProjectedEvent struct {
	Mount, Dir, Medium string
	// Op is the operation: "setup", "remount" or "verify" (a repair).
	Op string
	// Revision names the snapshots of the payload, per projection, such
	// as "main@1042,web@sha256:ab…".
	Revision string
	// Version is the version directory ..data names.
	Version string
	// Change lists the paths added, changed and removed.
	Change projector.Change
	// Files and Bytes measure the payload.
	Files int
	Bytes int64
	// Duration is how long the operation took.
	Duration time.Duration
	Time     time.Time
}

// FailedEvent: an operation failed; the mount keeps its last content and
// is retried after RetryIn — or, when RetryOnChange is set, at once when
// its payload changes.
type FailedEvent struct {
	Mount, Op string
	Err       error
	// Guard names the guard rail that refused the version, if one did:
	// "check_command" or "size_limit"; "mount_dir_replaced" when the
	// mount directory's path reaches another directory than the one
	// kvmount owns, or passes through a symlink (fsutil.ErrReplaced,
	// ErrSymlink, ErrNotDir), which kvmount refuses; or
	// "mount_dir_unrecognized" when kvmount cannot tell
	// (fsutil.ErrUnrecognized).
	Guard   string
	Attempt int
	RetryIn time.Duration
	// RetryOnChange reports that the failure was the payload's own
	// (Failure.PayloadCaused).
	RetryOnChange bool
	Time          time.Time
}

// HeldBackEvent: a guard rail kept a payload from replacing the mount's
// content; the next payload is tried.
type HeldBackEvent struct {
	Mount string
	// Guard is "min_keys" or "allow_empty" (the reconciler held back a
	// built payload), or "max_value_size", "max_mount_size" or
	// "max_files" (the populator could not build it).
	Guard, Reason, Revision string
	Time                    time.Time
}

// TornDownEvent: a mount no longer configured (or moved) was removed.
type TornDownEvent struct {
	Mount, Dir string
	Time       time.Time
}

// SourceEvent: a source became readable (Err nil) or not, as seen by the
// feeds the mounts use; Revision is the newest revision read from it.
type SourceEvent struct {
	Source   string
	Err      error
	Revision string
	Time     time.Time
}

// PassEvent follows a pass of the reconciler's loop with the status of
// every configured mount, sorted by name: at most one every 50 ms
// (statusEvery). A pass sooner after the last report leaves its status to
// the first pass at the end of that interval, which it makes due, or to
// the end of Run, so the last status of a burst is always reported.
type PassEvent struct {
	Mounts []MountStatus
	Time   time.Time
}

func (ProjectedEvent) isEvent() {}
func (FailedEvent) isEvent()    {}
func (HeldBackEvent) isEvent()  {}
func (TornDownEvent) isEvent()  {}
func (SourceEvent) isEvent()    {}
func (PassEvent) isEvent()      {}

// Observers hands each event to every observer, in order.
type Observers []Observer

// Observe implements Observer.
func (os Observers) Observe(ev Event) {
	for _, o := range os {
		o.Observe(ev)
	}
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(Event)

// Observe calls f(ev).
func (f ObserverFunc) Observe(ev Event) { f(ev) }

// discardObserver drops every event.
type discardObserver struct{}

func (discardObserver) Observe(Event) {}
