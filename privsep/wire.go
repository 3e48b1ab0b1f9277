package privsep

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// The wire protocol between the worker and the monitor, over a stream
// socket (a socketpair). A frame is a header of five bytes — the body's
// length (big-endian uint32) and the message type — and the body. Strings
// in a body are a big-endian uint16 length and the bytes (uint32 for a
// file's content); lists are a uint16 count and their strings; numbers are
// big-endian. A payload crosses as Begin, then for each file a File and
// the Data chunks of its bytes, then Commit: no frame of the worker's is
// larger than MaxChunk, whatever the payload, and the monitor holds one
// payload of one mount at a time, within that mount's limits (Assembler).
// messages.go lists the messages and which side sends each.
//
// The decoder trusts nothing: a type the other side does not send, or a
// length over its type's bound, is refused before anything is read or
// allocated; a body must be consumed exactly; a frame cut short is an
// error. Every error wraps ErrMalformed, or ErrTruncated for a frame cut
// short.

// Side is the sender of a stream of frames: a decoder accepts only the
// messages its side sends.
type Side int

const (
	// FromWorker: payloads, states, log records and requests.
	FromWorker Side = iota
	// FromMonitor: the configuration's inputs, Apply and answers.
	FromMonitor
)

// ErrMalformed is wrapped by every error of a frame that breaks the
// protocol; ErrTruncated by that of a stream that ends inside a frame.
var (
	ErrMalformed = errors.New("malformed frame")
	ErrTruncated = errors.New("frame cut short")
)

// Message is one message of the protocol (messages.go).
type Message interface {
	msgType() byte
	// put appends the message's body to b; an error wraps ErrMalformed.
	put(b []byte) ([]byte, error)
}

// Encoder writes messages as frames.
type Encoder struct {
	w   *bufio.Writer
	buf []byte
	// hdr, file and data are each frame's header and EncodeFile's
	// messages, kept here so that a file costs no allocation of its own.
	hdr  [5]byte
	file File
	data Data
}

// NewEncoder returns an encoder writing to w.
func NewEncoder(w io.Writer) *Encoder { return &Encoder{w: bufio.NewWriter(w)} }

// Fits returns nil when m is within the protocol's bounds, else the error
// wrapping ErrMalformed that Encode would return.
func Fits(m Message) error {
	_, err := m.put(nil)
	return err
}

// Encode writes m as one frame (EncodeFile writes a file with its bytes).
// It returns an error wrapping ErrMalformed for a message over the
// protocol's bounds (nothing is written then), or the writer's error.
// Frames are buffered until Flush.
func (e *Encoder) Encode(m Message) error {
	b, err := m.put(e.buf[:0])
	e.buf = b
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint32(e.hdr[:4], uint32(len(b)))
	e.hdr[4] = m.msgType()
	if _, err := e.w.Write(e.hdr[:]); err != nil {
		return err
	}
	_, err = e.w.Write(b)
	return err
}

// EncodeFile writes a File for path and its bytes as Data chunks.
func (e *Encoder) EncodeFile(path string, mode uint32, data []byte) error {
	// Nothing of the caller's is kept past the call.
	defer func() { e.file, e.data = File{}, Data{} }()
	e.file = File{Path: path, Mode: mode, Size: uint64(len(data))}
	if err := e.Encode(&e.file); err != nil {
		return err
	}
	for len(data) > 0 {
		n := min(len(data), MaxChunk)
		e.data = Data{Bytes: data[:n]}
		if err := e.Encode(&e.data); err != nil {
			return err
		}
		data = data[n:]
	}
	return nil
}

// Flush writes the buffered frames.
func (e *Encoder) Flush() error { return e.w.Flush() }

// putString appends s with its length, or returns an error wrapping
// ErrMalformed when s is longer than most bytes.
func putString(b []byte, s string, most int) ([]byte, error) {
	if len(s) > most {
		return b, fmt.Errorf("%w: a string of %d bytes, more than %d", ErrMalformed, len(s), most)
	}
	b = binary.BigEndian.AppendUint16(b, uint16(len(s)))
	return append(b, s...), nil
}

// putBytes appends v with a uint32 length, or returns an error wrapping
// ErrMalformed when v is longer than most bytes.
func putBytes(b, v []byte, most int) ([]byte, error) {
	if len(v) > most {
		return b, fmt.Errorf("%w: %d bytes, more than %d", ErrMalformed, len(v), most)
	}
	b = binary.BigEndian.AppendUint32(b, uint32(len(v)))
	return append(b, v...), nil
}

// putList appends the count of list and its strings, or returns an error
// wrapping ErrMalformed for more than MaxListLen strings or one longer
// than most bytes.
func putList(b []byte, list []string, most int) ([]byte, error) {
	if len(list) > MaxListLen {
		return b, fmt.Errorf("%w: a list of %d strings, more than %d", ErrMalformed, len(list), MaxListLen)
	}
	b = binary.BigEndian.AppendUint16(b, uint16(len(list)))
	var err error
	for _, s := range list {
		if b, err = putString(b, s, most); err != nil {
			return b, err
		}
	}
	return b, nil
}

// writer collects a body's fields; the first error sticks.
type writer struct {
	b   []byte
	err error
}

func (w *writer) string(s string, most int) {
	if w.err == nil {
		w.b, w.err = putString(w.b, s, most)
	}
}

func (w *writer) bytes(v []byte, most int) {
	if w.err == nil {
		w.b, w.err = putBytes(w.b, v, most)
	}
}

func (w *writer) list(l []string, most int) {
	if w.err == nil {
		w.b, w.err = putList(w.b, l, most)
	}
}

func (w *writer) uint32(v uint32) { w.b = binary.BigEndian.AppendUint32(w.b, v) }
func (w *writer) uint64(v uint64) { w.b = binary.BigEndian.AppendUint64(w.b, v) }

// Decoder reads frames as messages.
type Decoder struct {
	r    *bufio.Reader
	from Side
	buf  []byte
	// file and data are the messages a File and a Data frame decode
	// into, one each per decoder: a payload's frames are one or two per
	// file, and none of them is kept past its turn.
	file File
	data Data
	// hdr and p read each frame's header and body, kept here so that a
	// frame costs no allocation of its own.
	hdr [5]byte
	p   parser
}

// NewDecoder returns a decoder reading from r the messages that from
// sends.
func NewDecoder(r io.Reader, from Side) *Decoder {
	return &Decoder{r: bufio.NewReader(r), from: from}
}

// Ready reports whether a whole frame is buffered, so that the next Decode
// returns without reading from the stream.
func (d *Decoder) Ready() bool {
	n := d.r.Buffered()
	if n < 5 {
		return false
	}
	hdr, err := d.r.Peek(5)
	return err == nil && int64(n) >= 5+int64(binary.BigEndian.Uint32(hdr[:4]))
}

// Decode reads the next message. It returns io.EOF at the end of the
// stream between frames, an error wrapping ErrTruncated when it ends
// inside one, and an error wrapping ErrMalformed for a frame that breaks
// the protocol (a type the other side does not send, or a length over the
// type's bound, is refused before the body is read). A *File or *Data
// returned is the decoder's own, overwritten by the next call, and a
// *Data's Bytes too: take what is kept before calling again.
func (d *Decoder) Decode() (Message, error) {
	hdr := d.hdr[:]
	if _, err := io.ReadFull(d.r, hdr); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, fmt.Errorf("%w: in a header", ErrTruncated)
		}
		return nil, err
	}
	n, t := binary.BigEndian.Uint32(hdr[:4]), hdr[4]
	k, ok := messageKinds[t]
	switch {
	case !ok:
		return nil, fmt.Errorf("%w: unknown type %d", ErrMalformed, t)
	case k.from != d.from:
		return nil, fmt.Errorf("%w: type %d is not the %s's to send", ErrMalformed, t, d.from)
	case int64(n) > int64(k.most):
		return nil, fmt.Errorf("%w: a body of %d bytes for type %d, at most %d", ErrMalformed, n, t, k.most)
	}
	if cap(d.buf) < int(n) {
		d.buf = make([]byte, n)
	}
	body := d.buf[:n]
	if _, err := io.ReadFull(d.r, body); err != nil {
		return nil, fmt.Errorf("%w: in a body of %d bytes", ErrTruncated, n)
	}
	p := &d.p
	*p = parser{b: body}
	m := k.decode(p, d)
	if err := p.done(); err != nil {
		return nil, fmt.Errorf("%w: type %d: %v", ErrMalformed, t, err)
	}
	return m, nil
}

// String names the side.
func (s Side) String() string {
	if s == FromMonitor {
		return "monitor"
	}
	return "worker"
}

// parser reads a body's fields; the first problem sticks.
type parser struct {
	b   []byte
	err error
}

func (p *parser) take(n int) []byte {
	if p.err != nil {
		return nil
	}
	if n < 0 || n > len(p.b) {
		p.err = fmt.Errorf("a field of %d bytes where %d remain", n, len(p.b))
		return nil
	}
	v := p.b[:n]
	p.b = p.b[n:]
	return v
}

func (p *parser) uint16() int {
	if v := p.take(2); v != nil {
		return int(binary.BigEndian.Uint16(v))
	}
	return 0
}

func (p *parser) uint32() uint32 {
	if v := p.take(4); v != nil {
		return binary.BigEndian.Uint32(v)
	}
	return 0
}

func (p *parser) uint64() uint64 {
	if v := p.take(8); v != nil {
		return binary.BigEndian.Uint64(v)
	}
	return 0
}

// bytes reads a uint32 length and that many bytes, at most most, as a
// copy.
func (p *parser) bytes(most int) []byte {
	n := int64(p.uint32())
	if n > int64(most) && p.err == nil {
		p.err = fmt.Errorf("a field of %d bytes, more than %d", n, most)
	}
	return append([]byte(nil), p.take(int(n))...)
}

func (p *parser) string(most int) string {
	n := p.uint16()
	if n > most && p.err == nil {
		p.err = fmt.Errorf("a string of %d bytes, more than %d", n, most)
	}
	return string(p.take(n))
}

func (p *parser) list(most int) []string {
	n := p.uint16()
	if n > MaxListLen && p.err == nil {
		p.err = fmt.Errorf("a list of %d strings, more than %d", n, MaxListLen)
	}
	if p.err != nil || n == 0 {
		return nil
	}
	out := make([]string, 0, n)
	for range n {
		out = append(out, p.string(most))
	}
	return out
}

func (p *parser) rest() []byte {
	v := p.b
	p.b = nil
	return v
}

// done returns the first problem, or one for bytes left over.
func (p *parser) done() error {
	if p.err == nil && len(p.b) > 0 {
		p.err = fmt.Errorf("%d bytes left over", len(p.b))
	}
	return p.err
}
