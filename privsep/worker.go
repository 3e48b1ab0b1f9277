package privsep

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

// MonitorLink is the worker's side of the seam: what it sends its
// monitor — reports, payloads, log records, requests for credential
// files — and what it takes from it (Serve). Its methods are safe for
// concurrent use.
type MonitorLink struct {
	r io.Reader

	mu  sync.Mutex
	enc *Encoder

	rereads rereads
}

// NewMonitorLink returns the link over conn, the worker's end of the
// socket to its monitor (WorkerConn).
func NewMonitorLink(conn io.ReadWriter) *MonitorLink {
	l := &MonitorLink{r: conn, enc: NewEncoder(conn)}
	l.rereads = rereads{link: l, waiting: map[string][]chan *Credential{}, asked: map[string]bool{}}
	return l
}

// Send writes msgs and flushes them.
func (l *MonitorLink) Send(msgs ...Message) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.encode(msgs); err != nil {
		return err
	}
	return l.enc.Flush()
}

// Queue writes msgs without flushing them: they go with the next Flush,
// or the next Send.
func (l *MonitorLink) Queue(msgs ...Message) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.encode(msgs)
}

// encode encodes msgs; l.mu is held.
func (l *MonitorLink) encode(msgs []Message) error {
	for _, m := range msgs {
		if err := l.enc.Encode(m); err != nil {
			return err
		}
	}
	return nil
}

// Flush writes what was queued.
func (l *MonitorLink) Flush() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.enc.Flush()
}

// QueuePayload queues st and then payload, its files in path order (they
// are written as the encoder's buffer fills, the rest at the next Flush).
// Modes are sent for the record only: the monitor takes owners and modes
// from its configuration.
func (l *MonitorLink) QueuePayload(st *MountState, payload projector.Payload) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.enc.Encode(st); err != nil {
		return err
	}
	if err := l.enc.Encode(&Begin{Mount: st.Mount, Revision: st.Revision, Files: uint32(len(payload))}); err != nil {
		return err
	}
	for _, p := range slices.Sorted(maps.Keys(payload)) {
		f := payload[p]
		if err := l.enc.EncodeFile(p, uint32(f.Mode.Perm()), f.Data); err != nil {
			return err
		}
	}
	return l.enc.Encode(&Commit{})
}

// MonitorHandlers are what a worker does with the monitor's requests
// (MonitorLink.Serve).
type MonitorHandlers struct {
	// Apply runs a configuration: the Apply with the Inputs sent before
	// it. It is called on Serve's goroutine, in order.
	Apply func(a *Apply, inputs map[string][]byte)
	// Post delivers a webhook; it is called on a goroutine of its own.
	Post func(ctx context.Context, p *Post)
	// Resend sends a mount's payload again; it is called on Serve's
	// goroutine and must not block.
	Resend func(mount string)
	// OnDisk takes the digest of what a mount holds on disk, and the
	// owner of its files (OnDisk); it is called on Serve's goroutine and
	// must not block. Nil drops it: every payload is then sent whole.
	OnDisk func(m *OnDisk)
}

// Serve decodes the monitor's messages until the stream ends, and returns
// why (io.EOF, or the decoder's error): Inputs are gathered until an
// Apply, which is handed to h.Apply with them; Credentials go to the
// reads waiting for them (Files); each Post is handed to h.Post, each
// Resend to h.Resend, each OnDisk to h.OnDisk.
func (l *MonitorLink) Serve(ctx context.Context, h MonitorHandlers) error {
	d := NewDecoder(l.r, FromMonitor)
	inputs := map[string][]byte{}
	for {
		m, err := d.Decode()
		if err != nil {
			return err
		}
		switch m := m.(type) {
		case *Input:
			inputs[m.Name] = m.Value
		case *Apply:
			h.Apply(m, inputs)
			inputs = map[string][]byte{}
		case *Credential:
			l.rereads.answer(m)
		case *Post:
			go h.Post(ctx, m)
		case *Resend:
			h.Resend(m.Mount)
		case *OnDisk:
			if h.OnDisk != nil {
				h.OnDisk(m)
			}
		}
	}
}

// Files returns the worker's config.Files for the credential files a
// source reads again while it runs: each read is a Reread to the
// monitor, which answers with the file's content or why it cannot.
func (l *MonitorLink) Files() config.Files { return &l.rereads }

// rereadTimeout bounds the wait for the monitor's answer to a Reread.
const rereadTimeout = 10 * time.Second

// rereads is MonitorLink.Files.
type rereads struct {
	link    *MonitorLink
	mu      sync.Mutex
	waiting map[string][]chan *Credential
	// asked holds the files asked for whose answer has not come: the
	// monitor takes one request per file in flight (requests.go), so a
	// read of a file already asked for waits for that answer.
	asked map[string]bool
}

// Read implements config.Files.
func (r *rereads) Read(name string, limit int64) ([]byte, *unix.Stat_t, error) {
	ch := make(chan *Credential, 1)
	r.mu.Lock()
	r.waiting[name] = append(r.waiting[name], ch)
	ask := !r.asked[name]
	r.asked[name] = true
	r.mu.Unlock()
	if ask {
		if err := r.link.Send(&Reread{Name: name}); err != nil {
			r.mu.Lock()
			delete(r.asked, name)
			r.mu.Unlock()
			r.forget(name, ch)
			return nil, nil, err
		}
	}
	select {
	case c := <-ch:
		if c.Err != "" {
			return nil, nil, errors.New(c.Err)
		}
		return config.Replay{name: c.Value}.Read(name, limit)
	case <-time.After(rereadTimeout):
		r.forget(name, ch)
		return nil, nil, fmt.Errorf("%s: the monitor did not answer within %v", name, rereadTimeout)
	}
}

// forget removes ch, a read that gave up, from those waiting for name.
func (r *rereads) forget(name string, ch chan *Credential) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waiting[name] = slices.DeleteFunc(r.waiting[name], func(c chan *Credential) bool { return c == ch })
	if len(r.waiting[name]) == 0 {
		delete(r.waiting, name)
	}
}

// answer hands c to the reads waiting for its file.
func (r *rereads) answer(c *Credential) {
	r.mu.Lock()
	chans := r.waiting[c.Name]
	delete(r.waiting, c.Name)
	delete(r.asked, c.Name)
	r.mu.Unlock()
	for _, ch := range chans {
		ch <- c
	}
}

// Handler returns the worker's slog.Handler, of records at level and
// above: each goes to the monitor as a Log message, its attributes as
// strings (at most MaxListLen, the last pair saying how many were left
// out), which the monitor logs with its own handler (escaping them).
func (l *MonitorLink) Handler(level slog.Leveler) slog.Handler {
	return &logHandler{link: l, level: level}
}

// logHandler is MonitorLink.Handler.
type logHandler struct {
	link  *MonitorLink
	level slog.Leveler
	attrs []string
	group string
}

func (h *logHandler) Enabled(_ context.Context, l slog.Level) bool {
	return l >= h.level.Level()
}

func (h *logHandler) Handle(_ context.Context, r slog.Record) error {
	attrs := slices.Clone(h.attrs)
	r.Attrs(func(a slog.Attr) bool {
		attrs = appendAttr(attrs, h.group, a)
		return true
	})
	if len(attrs) > MaxListLen {
		// Keys and values go in pairs: the last pair says how many
		// were left out.
		keep := MaxListLen - 2
		attrs = append(attrs[:keep:keep], "attrs_dropped", strconv.Itoa((len(attrs)-keep)/2))
	}
	return h.link.Send(&Log{Level: int32(r.Level), Message: Clip(r.Message, MaxDetailLen), Attrs: attrs})
}

func (h *logHandler) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	c.attrs = slices.Clone(h.attrs)
	for _, a := range as {
		c.attrs = appendAttr(c.attrs, h.group, a)
	}
	return &c
}

func (h *logHandler) WithGroup(name string) slog.Handler {
	c := *h
	c.group = h.group + name + "."
	return &c
}

// appendAttr appends a's key, with group before it, and its value as a
// string; a group's attributes one by one.
func appendAttr(out []string, group string, a slog.Attr) []string {
	v := a.Value.Resolve()
	if v.Kind() == slog.KindGroup {
		for _, g := range v.Group() {
			out = appendAttr(out, group+a.Key+".", g)
		}
		return out
	}
	var s string
	if err, ok := v.Any().(error); ok && v.Kind() == slog.KindAny {
		s = err.Error()
	} else {
		s = v.String()
	}
	return append(out, Clip(group+a.Key, MaxDetailLen), Clip(s, MaxDetailLen))
}

// Clip returns s cut to at most n bytes: a string within the protocol's
// bound of its field.
func Clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
