package privsep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/source"
)

// WorkerFD is the descriptor on which a worker finds its end of the
// socket to the monitor (the first of exec.Cmd.ExtraFiles).
const WorkerFD = 3

// WorkerConn returns the worker's end of the socket to the monitor.
func WorkerConn() *os.File { return os.NewFile(WorkerFD, "privsep") }

// drainTimeout bounds the reading of what a worker sent before it ended.
const drainTimeout = time.Second

// StopGrace is how long a worker has to exit after SIGTERM before it is
// killed.
const StopGrace = 5 * time.Second

// Supervisor runs the worker as Identity, reads its messages, and starts
// it again, with backoff (0.5 s doubling to 30 s, as a source's retries),
// whenever it ends: a worker that dies or breaks the protocol is logged
// and counted, and what the mounts hold stays as it is. The monitor never
// waits on the worker: messages are read on a goroutine of their own, and
// nothing is sent to it that could block.
type Supervisor struct {
	// Command returns the worker's command, a new one for every start;
	// its ExtraFiles are the supervisor's to set.
	Command func() *exec.Cmd
	// Identity is the user and group the worker runs as.
	Identity Identity
	// Mounts returns the mounts of the configuration and their limits, at
	// every start of the worker.
	Mounts func() map[string]MountLimits
	// OnPayload and OnState receive the worker's payloads, assembled and
	// checked, and its sources' states, in order, on the goroutine that
	// reads the worker.
	OnPayload func(*Payload)
	OnState   func(*State)
	// Log receives the worker's starts, ends and refusals. A refusal's
	// error quotes what the worker sent (a path, a mount's name): Log's
	// handler must escape outside text, as the daemon's does
	// (untrusted.Escape).
	Log *slog.Logger

	starts, refusals atomic.Uint64
}

// Starts returns how many times a worker was started.
func (s *Supervisor) Starts() uint64 { return s.starts.Load() }

// Refusals returns how many workers were stopped for breaking the
// protocol or a guard rail.
func (s *Supervisor) Refusals() uint64 { return s.refusals.Load() }

// Run starts the worker and starts it again whenever it ends, until ctx is
// done; then it stops the worker (SIGTERM, and SIGKILL after StopGrace)
// and returns ctx's error. It returns at once an error of a start that
// cannot succeed on any later try (a refused Identity).
func (s *Supervisor) Run(ctx context.Context) error {
	bo := source.NewBackoff()
	for {
		began := time.Now()
		err := s.runOnce(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if errors.Is(err, errIdentity) {
			return err
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

// runOnce runs one worker until it ends, breaks the protocol, or ctx is
// done, and returns why it ended.
func (s *Supervisor) runOnce(ctx context.Context) error {
	if s.Identity.UID == 0 || s.Identity.GID == 0 {
		return fmt.Errorf("%w: uid %d, gid %d", errIdentity, s.Identity.UID, s.Identity.GID)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("privsep: socketpair: %w", err)
	}
	// The monitor's end is non-blocking, so that its reads go through Go's
	// poller and Close ends one in progress, whoever holds the other end.
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return fmt.Errorf("privsep: socketpair: %w", err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "privsep-monitor"), os.NewFile(uintptr(fds[1]), "privsep-worker")
	defer mine.Close()
	cmd := s.Command()
	cmd.ExtraFiles = []*os.File{theirs}
	w, err := Spawn(cmd, s.Identity)
	theirs.Close()
	if err != nil {
		return fmt.Errorf("privsep: starting the worker: %w", err)
	}
	s.starts.Add(1)
	s.Log.Info("worker started", "pid", w.Process.Pid, "uid", s.Identity.UID)

	read := make(chan error, 1)
	go func() { read <- s.read(mine) }()
	var why, readErr error
	readDone := false
	select {
	case <-ctx.Done():
		_ = w.Process.Signal(syscall.SIGTERM)
		select {
		case <-w.Done():
		case <-time.After(StopGrace):
			_ = w.Process.Kill()
		}
		why = ctx.Err()
	case readErr = <-read:
		// The stream ended or broke the protocol: this worker is done.
		readDone = true
		if errors.Is(readErr, ErrRefused) || errors.Is(readErr, ErrMalformed) || errors.Is(readErr, ErrTruncated) {
			s.refusals.Add(1)
			s.Log.Error("the worker broke the protocol; stopping it, and keeping every mount's content", "err", readErr)
		}
		_ = w.Process.Kill()
	case <-w.Done():
		// What it sent before it ended is still read, to the stream's end.
	}
	werr := w.Wait()
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
	if why == nil {
		why = readErr
	}
	if werr != nil && ctx.Err() == nil {
		why = fmt.Errorf("%w (its messages: %v)", werr, why)
	}
	return why
}

// read decodes the worker's messages until the stream ends, and returns
// why it did: io.EOF, or an error wrapping ErrMalformed, ErrTruncated or
// ErrRefused.
func (s *Supervisor) read(r io.Reader) error {
	d := NewDecoder(r)
	a := NewAssembler(s.Mounts())
	for {
		m, err := d.Decode()
		if err != nil {
			return err
		}
		if st, ok := m.(*State); ok {
			if s.OnState != nil {
				s.OnState(st)
			}
			continue
		}
		p, err := a.Add(m)
		if err != nil {
			return err
		}
		if p != nil && s.OnPayload != nil {
			s.OnPayload(p)
		}
	}
}
