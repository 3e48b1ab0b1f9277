package privsep

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/kvmount/kvmount/projector"
)

// The wire protocol between the worker and the monitor, over a stream
// socket (a socketpair). A frame is a header of five bytes — the body's
// length (big-endian uint32) and the message type — and the body. Strings
// in a body are a big-endian uint16 length and the bytes; numbers are
// big-endian. A payload crosses as Begin, then for each file a File and
// the Data chunks of its bytes, then Commit: no frame is larger than
// MaxFrame, whatever the payload, and the monitor holds one payload of
// one mount at a time, within that mount's limits (Assembler).
//
// The decoder trusts nothing: a length over its bound is refused before
// anything is read or allocated, a body must be consumed exactly, and an
// unknown type or a frame cut short is an error. Every error wraps
// ErrMalformed, or ErrTruncated for a frame cut short.

// Bounds of the protocol.
const (
	// MaxChunk is the most file bytes one Data frame carries.
	MaxChunk = 256 << 10
	// MaxFrame is the largest frame body of any type, in bytes: a Data
	// frame's (every other type's bound is smaller).
	MaxFrame = MaxChunk
	// MaxNameLen bounds a mount's and a source's name, in bytes.
	MaxNameLen = 255
	// MaxRevisionLen bounds a revision, in bytes (source.BoundRevision
	// keeps revisions within 128).
	MaxRevisionLen = 128
	// MaxPathLen bounds a file's path, in bytes (the kubelet's,
	// projector.MaxPathLength).
	MaxPathLen = projector.MaxPathLength
	// MaxDetailLen bounds a State's detail, in bytes.
	MaxDetailLen = 4096
	// MaxCredentialLen bounds a Credential's value, in bytes (credential
	// files are at most 64 KiB).
	MaxCredentialLen = 64 << 10
)

// Message types, the fifth byte of a frame's header.
const (
	typeBegin      = 1
	typeFile       = 2
	typeData       = 3
	typeCommit     = 4
	typeState      = 5
	typeCredential = 6
)

// ErrMalformed is wrapped by every error of a frame that breaks the
// protocol; ErrTruncated by that of a stream that ends inside a frame.
var (
	ErrMalformed = errors.New("malformed frame")
	ErrTruncated = errors.New("frame cut short")
)

// Message is one message of the protocol: *Begin, *File, *Data, *Commit,
// *State or *Credential.
type Message interface {
	msgType() byte
}

// Begin starts a payload of Files files for mount Mount at Revision.
type Begin struct {
	Mount, Revision string
	Files           uint32
}

// File starts a file of the payload begun: its path in the mount, its
// permission bits and its size in bytes; Data frames carry its bytes.
type File struct {
	Path string
	Mode uint32
	Size uint64
}

// Data is a chunk of the current file's bytes, at most MaxChunk.
type Data struct {
	Bytes []byte
}

// Commit ends the payload begun.
type Commit struct{}

// State reports a source's state, for the log, /status and metrics.
type State struct {
	Source  string
	Healthy bool
	Detail  string
}

// Credential passes the contents of a credential file the monitor read
// (a token, a password) to the worker, which may not read the file.
type Credential struct {
	Name  string
	Value []byte
}

func (*Begin) msgType() byte      { return typeBegin }
func (*File) msgType() byte       { return typeFile }
func (*Data) msgType() byte       { return typeData }
func (*Commit) msgType() byte     { return typeCommit }
func (*State) msgType() byte      { return typeState }
func (*Credential) msgType() byte { return typeCredential }

// Encoder writes messages as frames.
type Encoder struct {
	w   *bufio.Writer
	buf []byte
}

// NewEncoder returns an encoder writing to w.
func NewEncoder(w io.Writer) *Encoder { return &Encoder{w: bufio.NewWriter(w)} }

// Encode writes m as one frame (EncodeFile writes a file with its bytes).
// It returns an error wrapping ErrMalformed for a message over the
// protocol's bounds (nothing is written then), or the writer's error.
// Frames are buffered until Flush.
func (e *Encoder) Encode(m Message) error {
	b := e.buf[:0]
	var err error
	switch m := m.(type) {
	case *Begin:
		b, err = putString(b, m.Mount, MaxNameLen)
		if err == nil {
			b, err = putString(b, m.Revision, MaxRevisionLen)
		}
		b = binary.BigEndian.AppendUint32(b, m.Files)
	case *File:
		b, err = putString(b, m.Path, MaxPathLen)
		b = binary.BigEndian.AppendUint32(b, m.Mode)
		b = binary.BigEndian.AppendUint64(b, m.Size)
	case *Data:
		if len(m.Bytes) > MaxChunk {
			err = fmt.Errorf("%w: a chunk of %d bytes, more than %d", ErrMalformed, len(m.Bytes), MaxChunk)
		}
		b = append(b, m.Bytes...)
	case *Commit:
	case *State:
		b, err = putString(b, m.Source, MaxNameLen)
		if m.Healthy {
			b = append(b, 1)
		} else {
			b = append(b, 0)
		}
		if err == nil {
			b, err = putString(b, m.Detail, MaxDetailLen)
		}
	case *Credential:
		b, err = putString(b, m.Name, MaxNameLen)
		if len(m.Value) > MaxCredentialLen {
			err = fmt.Errorf("%w: a credential of %d bytes, more than %d", ErrMalformed, len(m.Value), MaxCredentialLen)
		}
		b = binary.BigEndian.AppendUint32(b, uint32(len(m.Value)))
		b = append(b, m.Value...)
	default:
		err = fmt.Errorf("%w: message %T", ErrMalformed, m)
	}
	e.buf = b
	if err != nil {
		return err
	}
	var hdr [5]byte
	binary.BigEndian.PutUint32(hdr[:4], uint32(len(b)))
	hdr[4] = m.msgType()
	if _, err := e.w.Write(hdr[:]); err != nil {
		return err
	}
	_, err = e.w.Write(b)
	return err
}

// EncodeFile writes a File for path and its bytes as Data chunks.
func (e *Encoder) EncodeFile(path string, mode uint32, data []byte) error {
	if err := e.Encode(&File{Path: path, Mode: mode, Size: uint64(len(data))}); err != nil {
		return err
	}
	for len(data) > 0 {
		n := min(len(data), MaxChunk)
		if err := e.Encode(&Data{Bytes: data[:n]}); err != nil {
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

// Decoder reads frames as messages.
type Decoder struct {
	r   *bufio.Reader
	buf []byte
}

// NewDecoder returns a decoder reading from r.
func NewDecoder(r io.Reader) *Decoder { return &Decoder{r: bufio.NewReader(r)} }

// maxBody returns the largest body a frame of type t may have, in bytes;
// -1 for an unknown type.
func maxBody(t byte) int {
	switch t {
	case typeBegin:
		return 2 + MaxNameLen + 2 + MaxRevisionLen + 4
	case typeFile:
		return 2 + MaxPathLen + 4 + 8
	case typeData:
		return MaxChunk
	case typeCommit:
		return 0
	case typeState:
		return 2 + MaxNameLen + 1 + 2 + MaxDetailLen
	case typeCredential:
		return 2 + MaxNameLen + 4 + MaxCredentialLen
	}
	return -1
}

// Decode reads the next message. It returns io.EOF at the end of the
// stream between frames, an error wrapping ErrTruncated when it ends
// inside one, and an error wrapping ErrMalformed for a frame that breaks
// the protocol (its length over the type's bound is refused before the
// body is read). A *Data's Bytes are valid until the next call.
func (d *Decoder) Decode() (Message, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(d.r, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, fmt.Errorf("%w: in a header", ErrTruncated)
		}
		return nil, err
	}
	n, t := binary.BigEndian.Uint32(hdr[:4]), hdr[4]
	most := maxBody(t)
	switch {
	case most < 0:
		return nil, fmt.Errorf("%w: unknown type %d", ErrMalformed, t)
	case int64(n) > int64(most):
		return nil, fmt.Errorf("%w: a body of %d bytes for type %d, at most %d", ErrMalformed, n, t, most)
	}
	if cap(d.buf) < int(n) {
		d.buf = make([]byte, n)
	}
	body := d.buf[:n]
	if _, err := io.ReadFull(d.r, body); err != nil {
		return nil, fmt.Errorf("%w: in a body of %d bytes", ErrTruncated, n)
	}
	p := parser{b: body}
	var m Message
	switch t {
	case typeBegin:
		m = &Begin{Mount: p.string(MaxNameLen), Revision: p.string(MaxRevisionLen), Files: p.uint32()}
	case typeFile:
		m = &File{Path: p.string(MaxPathLen), Mode: p.uint32(), Size: p.uint64()}
	case typeData:
		m = &Data{Bytes: p.rest()}
	case typeCommit:
		m = &Commit{}
	case typeState:
		m = &State{Source: p.string(MaxNameLen), Healthy: p.bool(), Detail: p.string(MaxDetailLen)}
	case typeCredential:
		c := &Credential{Name: p.string(MaxNameLen)}
		c.Value = append([]byte(nil), p.bytes(int(p.uint32()), MaxCredentialLen)...)
		m = c
	}
	if err := p.done(); err != nil {
		return nil, fmt.Errorf("%w: type %d: %v", ErrMalformed, t, err)
	}
	return m, nil
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

func (p *parser) bool() bool {
	v := p.take(1)
	if v != nil && v[0] > 1 {
		p.err = fmt.Errorf("a boolean of %d", v[0])
	}
	return v != nil && v[0] == 1
}

func (p *parser) bytes(n, most int) []byte {
	if n > most && p.err == nil {
		p.err = fmt.Errorf("a field of %d bytes, more than %d", n, most)
	}
	return p.take(n)
}

func (p *parser) string(most int) string {
	var n int
	if v := p.take(2); v != nil {
		n = int(binary.BigEndian.Uint16(v))
	}
	return string(p.bytes(n, most))
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
