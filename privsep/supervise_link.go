package privsep

import (
	"errors"
	"fmt"
	"io"
	"sync"
)

// The Supervisor's side of one running worker's socket: the link that
// holds what is queued for the worker (bounded), the writer that sends it,
// the reader that takes the worker's frames through the request table
// (requests.go) and the assembler, and the answer to an Apply.

// link is one running worker: the messages queued for it, and its
// assembler's mounts.
type link struct {
	mu    sync.Mutex
	queue []Message
	// queued is the bytes queue holds (approximately: sizeOf), bounded by
	// maxQueued; breach receives the link's breach of a bound.
	queued, maxQueued int
	breach            chan error
	wake              chan struct{}
	// done is closed, and closed set, when the worker is gone.
	done   chan struct{}
	closed bool
	// mounts are the mounts the assembler takes payloads for: during a
	// reconfiguration, those of both configurations until the worker has
	// applied the new one (a payload of a removed mount may still be on
	// its way), then only the new one's.
	mounts  map[string]MountLimits
	pending map[uint32]map[string]MountLimits
	// phase is Running once the worker applied a configuration.
	phase Phase
	// applies are the Applies sent whose answer has not come, by Seq.
	applies map[uint32]bool
}

// send queues msgs for the worker; it never blocks. When the bytes queued
// would pass the link's bound — the worker reads nothing of what it is
// sent — nothing is queued and the link is breached.
func (l *link) send(msgs ...Message) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	n := 0
	for _, m := range msgs {
		n += sizeOf(m)
	}
	if l.maxQueued > 0 && l.queued+n > l.maxQueued {
		l.breached(fmt.Errorf("%w: the worker reads nothing of what the monitor sends it: %d bytes queued, more than %d", ErrRefused, l.queued+n, l.maxQueued))
		return
	}
	l.queue = append(l.queue, msgs...)
	l.queued += n
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// breached reports the link's first breach; the worker is stopped.
func (l *link) breached(err error) {
	select {
	case l.breach <- err:
	default:
	}
}

// sizeOf returns about how many bytes m takes queued.
func sizeOf(m Message) int {
	const overhead = 64
	switch m := m.(type) {
	case *Input:
		return overhead + len(m.Name) + len(m.Value)
	case *Credential:
		return overhead + len(m.Name) + len(m.Value) + len(m.Err)
	case *Post:
		n := overhead + len(m.URL) + len(m.Target) + len(m.Body)
		for _, h := range m.Header {
			n += len(h)
		}
		return n
	case *Apply:
		return overhead + len(m.Config)
	}
	return overhead
}

// write writes l's queued messages to w until l is closed or a write
// fails (the worker is gone).
func (s *Supervisor) write(w io.Writer, l *link) {
	e := NewEncoder(w)
	for {
		select {
		case <-l.done:
			return
		case <-l.wake:
		}
		l.mu.Lock()
		msgs := l.queue
		l.queue = nil
		l.mu.Unlock()
		for _, m := range msgs {
			if err := e.Encode(m); err != nil {
				if !errors.Is(err, ErrMalformed) {
					return
				}
				s.Log.Error("a message for the worker is over the protocol's bounds; not sent", "err", err)
			}
		}
		if err := e.Flush(); err != nil {
			return
		}
		n := 0
		for _, m := range msgs {
			n += sizeOf(m)
			if s.OnWritten != nil {
				s.OnWritten(m)
			}
		}
		l.mu.Lock()
		l.queued -= n
		l.mu.Unlock()
	}
}

// read decodes the worker's messages until the stream ends, and returns
// why it did: io.EOF, or an error wrapping ErrMalformed, ErrTruncated or
// ErrRefused.
func (s *Supervisor) read(r io.Reader, l *link) error {
	d := NewDecoder(r, FromWorker)
	l.mu.Lock()
	a := NewAssembler(l.mounts, s.Budget)
	l.mu.Unlock()
	for {
		if s.OnIdle != nil && !d.Ready() {
			s.OnIdle()
		}
		m, err := d.Decode()
		if err != nil {
			return err
		}
		l.mu.Lock()
		phase := l.phase
		l.mu.Unlock()
		if err := allowed(m, phase); err != nil {
			return err
		}
		switch m := m.(type) {
		case *Begin, *File, *Data, *Commit:
			if _, ok := m.(*Begin); ok {
				// Between payloads: take the mounts of the latest
				// configuration.
				l.mu.Lock()
				a.mounts = l.mounts
				l.mu.Unlock()
			}
			p, err := a.Add(m)
			if err != nil {
				return err
			}
			if p != nil {
				s.payloads.Add(1)
				if s.OnPayload != nil {
					s.OnPayload(p)
				}
			}
		case *Applied:
			if err := s.applied(l, m); err != nil {
				return err
			}
		default:
			if s.OnMessage != nil {
				if err := s.OnMessage(m); err != nil {
					return fmt.Errorf("%w: %w", ErrRefused, err)
				}
			}
		}
	}
}

// applied takes the worker's answer to an Apply: from now on its payloads
// are of that configuration's mounts, and a Configure waiting for it
// returns. An answer to no Apply in flight is a breach.
func (s *Supervisor) applied(l *link, m *Applied) error {
	l.mu.Lock()
	if !l.applies[m.Seq] {
		l.mu.Unlock()
		return fmt.Errorf("%w: the worker answered configuration %d, which it was not sent", ErrRefused, m.Seq)
	}
	delete(l.applies, m.Seq)
	if mounts, ok := l.pending[m.Seq]; ok && m.Err == "" {
		l.mounts = mounts
	}
	if m.Err == "" {
		l.phase = Running
	}
	delete(l.pending, m.Seq)
	l.mu.Unlock()
	s.mu.Lock()
	done := s.waiting[m.Seq]
	s.mu.Unlock()
	if m.Err != "" {
		s.Log.Error("the worker did not apply the configuration; it runs the one before", "err", m.Err)
	}
	if done != nil {
		var err error
		if m.Err != "" {
			err = fmt.Errorf("%w: %s", ErrNotApplied, m.Err)
		}
		done <- err
	}
	return nil
}
