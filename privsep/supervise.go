package privsep

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/source"
)

// WorkerFD is the descriptor on which a worker finds its end of the
// socket to the monitor (the first of exec.Cmd.ExtraFiles).
const WorkerFD = 3

// WorkerConn returns the worker's end of the socket to the monitor,
// close-on-exec: nothing the worker might start holds it.
func WorkerConn() *os.File {
	unix.CloseOnExec(WorkerFD)
	return os.NewFile(WorkerFD, "privsep")
}

// drainTimeout bounds the reading of what a worker sent before it ended,
// and the wait for its output pipes once it has exited: what holds them
// after it (a process it left behind) never holds the monitor.
const drainTimeout = 250 * time.Millisecond

// StopGrace is how long a worker has to exit after SIGTERM before it is
// killed.
const StopGrace = 5 * time.Second

// Configuration is what a worker runs: the configuration file's content
// and every file it names (Inputs, by name; Config names the
// configuration file among them), and the monitor's limits of each mount,
// by name, which the payloads must keep (Assembler).
type Configuration struct {
	Config string
	Inputs map[string][]byte
	Mounts map[string]MountLimits
}

// ErrNotApplied is wrapped by Configure's error when the worker did not
// take the configuration.
var ErrNotApplied = errors.New("the worker did not apply the configuration")

// Supervisor runs the worker as Identity, gives it its Configuration,
// reads its messages, and starts it again, with backoff (0.5 s doubling
// to 30 s, as a source's retries), whenever it ends: a worker that dies
// or breaks the protocol is logged and counted, and what the mounts hold
// stays as it is. The monitor never waits on the worker: messages are
// read on a goroutine of their own, and those sent to it are queued and
// written by another.
type Supervisor struct {
	// Command returns the worker's command, a new one for every start;
	// its ExtraFiles are the supervisor's to set.
	Command func() *exec.Cmd
	// Identity is the user and group the worker runs as.
	Identity Identity
	// OnPayload receives the worker's payloads, assembled and checked;
	// OnMessage its other messages (State, MountState, HeldBack, Log,
	// Reread, Posted) once the request table allows them in the worker's
	// phase (requests.go), and returns a breach of the request's budget,
	// after which the worker is stopped. Both are called in order, on
	// the goroutine that reads the worker, and must not block.
	OnPayload func(*Payload)
	OnMessage func(Message) error
	// OnStart, when set, returns the messages a worker is sent at each
	// start, after its configuration (Remote.StartMessages).
	OnStart func() []Message
	// OnIdle, when set, is called on the same goroutine whenever the
	// messages the worker sent so far are handled and the next is not in
	// yet: one call for the messages of one write, so that their reader
	// wakes whoever waits for them once, not at each message.
	OnIdle func()
	// OnWritten, when set, is called with each message sent to the
	// worker once it is written to the socket (an answer is out of the
	// monitor's hands then).
	OnWritten func(Message)
	// Budget, when set, bounds each payload by what max_total_size leaves
	// for its mount (Remote.Budget); a payload that passes it is a
	// breach of the protocol.
	Budget func(mount string) int64
	// OnEnd, when set, is called with why whenever a worker has ended
	// (and been waited for), before the next one starts: what it reported
	// is no longer kept current by anyone.
	OnEnd func(why error)
	// Log receives the worker's starts, ends and refusals. A refusal's
	// error quotes what the worker sent (a path, a mount's name): Log's
	// handler must escape outside text, as the daemon's does
	// (untrusted.Escape).
	Log *slog.Logger

	starts, refusals atomic.Uint64
	// payloads counts the payloads taken whole, unchanged those taken
	// as Unchanged (Remote.HandleUnchanged).
	payloads, unchanged atomic.Uint64

	mu sync.Mutex
	// cfg is the configuration a worker is given when it starts; seq
	// numbers the Applies.
	cfg Configuration
	seq uint32
	// link is the running worker's, nil between workers.
	link *link
	// waiting are the Configure calls waiting for an Applied, by Seq.
	waiting map[uint32]chan error
	// restart, when closed, makes the running worker stop and start again
	// at once.
	restart chan struct{}
	// worker and since are the running worker and its start, nil and
	// zero between workers; lastEnd says why the last one ended.
	worker  *Worker
	since   time.Time
	lastEnd string
}

// WorkerState is what a Supervisor knows of its worker, for /status and
// metrics.
type WorkerState struct {
	// PID is the running worker's process id, 0 while none runs (it is
	// being started again); Since is when it started.
	PID   int
	Since time.Time
	// Starts and Refusals are Supervisor.Starts and Supervisor.Refusals.
	Starts, Refusals uint64
	// Payloads counts the payloads its workers sent that were taken
	// whole; Unchanged those taken as an Unchanged, a digest equal to the
	// content on disk (OnDisk), which did not cross.
	Payloads, Unchanged uint64
	// LastEnd says why the last worker ended, "" while the first runs. It
	// may quote what a worker sent: escape it before showing it
	// (untrusted.Escape).
	LastEnd string
}

// State returns what s knows of its worker now.
func (s *Supervisor) State() WorkerState {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := WorkerState{Since: s.since, Starts: s.starts.Load(), Refusals: s.refusals.Load(), LastEnd: s.lastEnd,
		Payloads: s.payloads.Load(), Unchanged: s.unchanged.Load()}
	if s.worker != nil {
		st.PID = s.worker.Process.Pid
	}
	return st
}

// ErrNoWorker is returned by ObserveWorker while no worker runs.
var ErrNoWorker = errors.New("privsep: no worker runs")

// ObserveWorker returns the running worker as the kernel shows it
// (Observe), and its pid. The result is the worker's, never that of
// another process given its pid after it ended: it is returned only if
// the worker had not been waited for once it was read. It returns
// ErrNoWorker while none runs, or Observe's error.
func (s *Supervisor) ObserveWorker() (Observed, int, error) {
	s.mu.Lock()
	w := s.worker
	s.mu.Unlock()
	if w == nil {
		return Observed{}, 0, ErrNoWorker
	}
	o, err := Observe(w.Process.Pid)
	select {
	case <-w.Done():
		// Reaped: its pid may have been someone else's by then.
		return Observed{}, 0, ErrNoWorker
	default:
	}
	return o, w.Process.Pid, err
}

// Serves reports whether the running worker may report mount: whether
// mount is one of the configuration it runs, or of the one it is being
// given. It is false while no worker runs.
func (s *Supervisor) Serves(mount string) bool {
	s.mu.Lock()
	l := s.link
	s.mu.Unlock()
	if l == nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.mounts[mount]
	return ok
}

// maxQueuedBytes bounds what the monitor queues for a worker beyond its
// configuration's inputs: answers to its requests and webhooks to
// deliver, each bounded by the protocol, that it does not read.
const maxQueuedBytes = 64 << 20

// Breach stops the running worker as one that broke the protocol — what
// it asked or did is outside what the monitor allows (a request out of
// its turn, a bound passed) — counted and logged as such; err says what.
// It never blocks.
func (s *Supervisor) Breach(err error) {
	s.mu.Lock()
	l := s.link
	s.mu.Unlock()
	if l != nil {
		l.breached(fmt.Errorf("%w: %w", ErrRefused, err))
	}
}

// Starts returns how many times a worker was started.
func (s *Supervisor) Starts() uint64 { return s.starts.Load() }

// Refusals returns how many workers were stopped for breaking the
// protocol or a guard rail.
func (s *Supervisor) Refusals() uint64 { return s.refusals.Load() }

// Send queues msgs for the running worker, if one runs (answers to its
// requests, webhooks to deliver), and reports whether one did; it never
// blocks.
func (s *Supervisor) Send(msgs ...Message) bool {
	s.mu.Lock()
	l := s.link
	s.mu.Unlock()
	if l == nil {
		return false
	}
	l.send(msgs...)
	return true
}

// Configure makes c the configuration of the workers started from now on
// and, when a worker runs, hands it c and waits — until ctx is done at
// most — for it to apply it. With restart set (the worker's Landlock
// policy changes, which a running worker cannot widen) the running worker
// is stopped and a new one started with c at once. It returns an error
// wrapping ErrNotApplied when the running worker refused c: the
// configuration it runs stays the one of later starts too. With no worker
// running it returns nil: the next one starts with c.
func (s *Supervisor) Configure(ctx context.Context, c Configuration, restart bool) error {
	s.mu.Lock()
	prev := s.cfg
	s.cfg = c
	l := s.link
	if l == nil || restart {
		if restart && s.restart != nil {
			close(s.restart)
			s.restart = nil
		}
		s.mu.Unlock()
		return nil
	}
	s.seq++
	seq := s.seq
	done := make(chan error, 1)
	if s.waiting == nil {
		s.waiting = map[uint32]chan error{}
	}
	s.waiting[seq] = done
	s.mu.Unlock()

	l.mu.Lock()
	both := maps.Clone(l.mounts)
	maps.Copy(both, c.Mounts)
	l.mounts = both
	if l.pending == nil {
		l.pending = map[uint32]map[string]MountLimits{}
	}
	l.pending[seq] = c.Mounts
	l.applies[seq] = true
	l.mu.Unlock()
	l.send(configMessages(c, seq)...)

	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		err = fmt.Errorf("%w: no answer: %w", ErrNotApplied, ctx.Err())
	}
	s.mu.Lock()
	delete(s.waiting, seq)
	if err != nil && s.seq == seq {
		s.cfg = prev
	}
	s.mu.Unlock()
	return err
}

// configMessages returns the messages that give a worker c as Apply seq.
func configMessages(c Configuration, seq uint32) []Message {
	msgs := make([]Message, 0, len(c.Inputs)+1)
	for _, name := range slices.Sorted(maps.Keys(c.Inputs)) {
		msgs = append(msgs, &Input{Name: name, Value: c.Inputs[name]})
	}
	return append(msgs, &Apply{Seq: seq, Config: c.Config})
}

// Run starts the worker and starts it again whenever it ends, until ctx is
// done; then it stops the worker (SIGTERM, and SIGKILL after StopGrace)
// and returns ctx's error. It returns at once an error of a start that
// cannot succeed on any later try (a refused Identity).
func (s *Supervisor) Run(ctx context.Context) error {
	bo := source.NewBackoff()
	for {
		began := time.Now()
		restarted, err := s.runOnce(ctx)
		if s.OnEnd != nil {
			s.OnEnd(err)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, errIdentity) {
			return err
		}
		s.mu.Lock()
		s.lastEnd = "stopped for a new configuration"
		if !restarted {
			s.lastEnd = fmt.Sprint(err)
		}
		s.mu.Unlock()
		if restarted {
			s.Log.Info("the worker stopped for a new configuration; starting it again")
			continue
		}
		if time.Since(began) > source.RetryMax {
			bo.Reset()
		}
		wait := bo.NextBackOff()
		s.Log.Warn("the worker ended; starting it again", "err", err, "retry_in", wait)
		if !source.Sleep(ctx, wait) {
			return ctx.Err()
		}
	}
}

// errIdentity wraps Spawn's refusal of an identity.
var errIdentity = errors.New("privsep: refused identity")

// runOnce runs one worker until it ends, breaks the protocol, a restart is
// asked for (restarted) or ctx is done, and returns why it ended.
func (s *Supervisor) runOnce(ctx context.Context) (restarted bool, _ error) {
	if s.Identity.UID == 0 || s.Identity.GID == 0 {
		return false, fmt.Errorf("%w: uid %d, gid %d", errIdentity, s.Identity.UID, s.Identity.GID)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("privsep: socketpair: %w", err)
	}
	// The monitor's end is non-blocking, so that its reads and writes go
	// through Go's poller and Close ends one in progress, whoever holds
	// the other end.
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return false, fmt.Errorf("privsep: socketpair: %w", err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "privsep-monitor"), os.NewFile(uintptr(fds[1]), "privsep-worker")
	defer mine.Close()
	cmd := s.Command()
	cmd.ExtraFiles = []*os.File{theirs}
	// Wait returns once the worker has exited, whatever holds its output
	// pipes (a process it left behind): the monitor never waits on them.
	cmd.WaitDelay = drainTimeout
	w, err := Spawn(cmd, s.Identity)
	theirs.Close()
	if err != nil {
		return false, fmt.Errorf("privsep: starting the worker: %w", err)
	}
	s.starts.Add(1)
	s.Log.Info("worker started", "pid", w.Process.Pid, "uid", s.Identity.UID)

	restart := make(chan struct{})
	s.mu.Lock()
	s.seq++
	l := &link{wake: make(chan struct{}, 1), done: make(chan struct{}), mounts: s.cfg.Mounts, breach: make(chan error, 1),
		applies: map[uint32]bool{s.seq: true}}
	l.queue = configMessages(s.cfg, s.seq)
	if s.OnStart != nil {
		l.queue = append(l.queue, s.OnStart()...)
	}
	for _, m := range l.queue {
		l.queued += sizeOf(m)
	}
	l.maxQueued = l.queued + maxQueuedBytes
	l.wake <- struct{}{}
	s.link, s.restart = l, restart
	s.worker, s.since = w, time.Now()
	s.mu.Unlock()
	writeDone := make(chan struct{})
	defer func() {
		s.mu.Lock()
		s.link, s.worker, s.since = nil, nil, time.Time{}
		if s.restart == restart {
			s.restart = nil
		}
		s.mu.Unlock()
		l.mu.Lock()
		l.closed, l.queue = true, nil
		close(l.done)
		l.mu.Unlock()
		<-writeDone
	}()
	go func() {
		defer close(writeDone)
		s.write(mine, l)
	}()

	read := make(chan error, 1)
	go func() { read <- s.read(mine, l) }()
	var why, readErr, breach error
	readDone := false
	stop := func() {
		_ = w.Process.Signal(syscall.SIGTERM)
		select {
		case <-w.Done():
		case <-time.After(StopGrace):
			_ = w.Process.Kill()
		}
	}
	select {
	case <-ctx.Done():
		stop()
		why = ctx.Err()
	case <-restart:
		stop()
		restarted = true
	case readErr = <-read:
		// The stream ended or broke the protocol: this worker is done.
		readDone = true
		_ = w.Process.Kill()
	case breach = <-l.breach:
		// It broke a bound the monitor keeps: this worker is done.
		_ = w.Process.Kill()
	case <-w.Done():
		// What it sent before it ended is still read, to the stream's end.
	}
	werr := w.Wait()
	if cmd.SysProcAttr != nil && cmd.SysProcAttr.Setpgid {
		// Whatever the worker left in its process group ends with it.
		_ = unix.Kill(-w.Process.Pid, unix.SIGKILL)
	}
	if !readDone {
		// A process the worker forked may hold its end open: read what is
		// left for a moment at most.
		select {
		case readErr = <-read:
		case <-time.After(drainTimeout):
			mine.Close()
			readErr = <-read
		}
	}
	mine.Close()
	if breach != nil {
		readErr = breach
	}
	// Whether it broke the protocol and then ended, or the other way
	// round, it is refused alike.
	if errors.Is(readErr, ErrRefused) || errors.Is(readErr, ErrMalformed) || errors.Is(readErr, ErrTruncated) {
		// Logged before it is counted: whoever sees the count finds the
		// reason in the log.
		s.Log.Error("the worker broke the protocol; stopping it, and keeping every mount's content", "err", readErr)
		s.refusals.Add(1)
	}
	if why == nil {
		why = readErr
	}
	if errors.Is(werr, exec.ErrWaitDelay) {
		werr = errors.New("it exited, and a process it left behind holds its output (killed with its process group)")
	}
	if werr != nil && ctx.Err() == nil && !restarted {
		why = fmt.Errorf("%w (its messages: %v)", werr, why)
	}
	return restarted, why
}
