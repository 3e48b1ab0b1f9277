package privsep

import (
	"fmt"
	"time"

	"github.com/kvmount/kvmount/projector"
)

// Bounds of the protocol.
const (
	// MaxChunk is the most file bytes one Data frame carries.
	MaxChunk = 256 << 10
	// MaxNameLen bounds a mount's and a source's name, a guard rail's and
	// a log attribute's key, in bytes.
	MaxNameLen = 255
	// MaxRevisionLen bounds a revision, in bytes: a mount's names the
	// revision of each of its projections, each bounded by
	// source.BoundRevision.
	MaxRevisionLen = 1024
	// MaxPathLen bounds a file's path in a mount, in bytes (the kubelet's,
	// projector.MaxPathLength).
	MaxPathLen = projector.MaxPathLength
	// MaxFileNameLen bounds the name of a file on the host (PATH_MAX).
	MaxFileNameLen = 4096
	// MaxDetailLen bounds an error's text, a log message and a log
	// attribute's value, in bytes.
	MaxDetailLen = 4096
	// MaxListLen bounds the strings of a list.
	MaxListLen = 64
	// MaxCredentialLen bounds a Credential's value, in bytes (credential
	// files are at most 64 KiB).
	MaxCredentialLen = 64 << 10
	// MaxInputLen bounds an Input's value, in bytes: the configuration
	// file, or a file it names.
	MaxInputLen = 4 << 20
	// MaxURLLen bounds a webhook's URL, and MaxHeaderLen each of its
	// headers' names and values, in bytes.
	MaxURLLen    = 8 << 10
	MaxHeaderLen = 8 << 10
	// MaxWebhookLen bounds a webhook's body, in bytes: the JSON of the
	// paths a change added, changed and removed.
	MaxWebhookLen = 4 << 20
	// MaxDigestLen bounds a payload's digest (projector.Payload.Digest:
	// a SHA-256 in hex), in bytes.
	MaxDigestLen = 64
)

// Message types, the fifth byte of a frame's header.
const (
	typeBegin      = 1
	typeFile       = 2
	typeData       = 3
	typeCommit     = 4
	typeState      = 5
	typeCredential = 6
	typeMountState = 7
	typeHeldBack   = 8
	typeLog        = 9
	typeApplied    = 10
	typeReread     = 11
	typeInput      = 12
	typeApply      = 13
	typePost       = 14
	typePosted     = 15
	typeResend     = 16
	typeOnDisk     = 17
	typeUnchanged  = 18
)

// kind is what the decoder knows of a message type: its sender, the
// largest body it may have (bytes) and how to read it.
type kind struct {
	from Side
	most int
	// decode reads a body; d lends the messages it reuses (Decoder).
	decode func(p *parser, d *Decoder) Message
}

var messageKinds = map[byte]kind{
	typeBegin: {FromWorker, 2 + MaxNameLen + 2 + MaxRevisionLen + 4, func(p *parser, _ *Decoder) Message {
		return &Begin{Mount: p.string(MaxNameLen), Revision: p.string(MaxRevisionLen), Files: p.uint32()}
	}},
	typeFile: {FromWorker, 2 + MaxPathLen + 4 + 8, func(p *parser, d *Decoder) Message {
		d.file = File{Path: p.string(MaxPathLen), Mode: p.uint32(), Size: p.uint64()}
		return &d.file
	}},
	typeData: {FromWorker, MaxChunk, func(p *parser, d *Decoder) Message {
		d.data = Data{Bytes: p.rest()}
		return &d.data
	}},
	typeCommit: {FromWorker, 0, func(*parser, *Decoder) Message { return &Commit{} }},
	typeState: {FromWorker, 2 + MaxNameLen + 2 + MaxDetailLen + 2 + MaxRevisionLen, func(p *parser, _ *Decoder) Message {
		return &State{Source: p.string(MaxNameLen), Err: p.string(MaxDetailLen), Revision: p.string(MaxRevisionLen)}
	}},
	typeMountState: {FromWorker, 2 + MaxNameLen + 8 + 2 + MaxRevisionLen + 2 + MaxDetailLen + 2 + MaxListLen*(2+MaxNameLen) + 2 + MaxListLen*(2+MaxDetailLen), func(p *parser, _ *Decoder) Message {
		return &MountState{Mount: p.string(MaxNameLen), Generation: p.uint64(), Revision: p.string(MaxRevisionLen), Err: p.string(MaxDetailLen), Waiting: p.list(MaxNameLen), Stale: p.list(MaxDetailLen)}
	}},
	typeHeldBack: {FromWorker, 2 + MaxNameLen + 2 + MaxNameLen + 2 + MaxDetailLen + 2 + MaxRevisionLen, func(p *parser, _ *Decoder) Message {
		return &HeldBack{Mount: p.string(MaxNameLen), Guard: p.string(MaxNameLen), Reason: p.string(MaxDetailLen), Revision: p.string(MaxRevisionLen)}
	}},
	typeLog: {FromWorker, 4 + 2 + MaxDetailLen + 2 + MaxListLen*(2+MaxDetailLen), func(p *parser, _ *Decoder) Message {
		l := &Log{Level: int32(p.uint32()), Message: p.string(MaxDetailLen), Attrs: p.list(MaxDetailLen)}
		if len(l.Attrs)%2 != 0 && p.err == nil {
			p.err = fmt.Errorf("%d attribute strings, not key and value pairs", len(l.Attrs))
		}
		return l
	}},
	typeApplied: {FromWorker, 4 + 2 + MaxDetailLen, func(p *parser, _ *Decoder) Message {
		return &Applied{Seq: p.uint32(), Err: p.string(MaxDetailLen)}
	}},
	typeReread: {FromWorker, 2 + MaxFileNameLen, func(p *parser, _ *Decoder) Message {
		return &Reread{Name: p.string(MaxFileNameLen)}
	}},
	typeCredential: {FromMonitor, 2 + MaxFileNameLen + 4 + MaxCredentialLen + 2 + MaxDetailLen, func(p *parser, _ *Decoder) Message {
		return &Credential{Name: p.string(MaxFileNameLen), Value: p.bytes(MaxCredentialLen), Err: p.string(MaxDetailLen)}
	}},
	typeInput: {FromMonitor, 2 + MaxFileNameLen + 4 + MaxInputLen, func(p *parser, _ *Decoder) Message {
		return &Input{Name: p.string(MaxFileNameLen), Value: p.bytes(MaxInputLen)}
	}},
	typeApply: {FromMonitor, 4 + 2 + MaxFileNameLen, func(p *parser, _ *Decoder) Message {
		return &Apply{Seq: p.uint32(), Config: p.string(MaxFileNameLen)}
	}},
	typePost: {FromMonitor, 4 + 2 + MaxURLLen + 2 + MaxDetailLen + 2 + MaxListLen*(2+MaxHeaderLen) + 4 + MaxWebhookLen + 8, func(p *parser, _ *Decoder) Message {
		m := &Post{Seq: p.uint32(), URL: p.string(MaxURLLen), Target: p.string(MaxDetailLen), Header: p.list(MaxHeaderLen), Body: p.bytes(MaxWebhookLen), Timeout: time.Duration(p.uint64())}
		if len(m.Header)%2 != 0 && p.err == nil {
			p.err = fmt.Errorf("%d header strings, not name and value pairs", len(m.Header))
		}
		return m
	}},
	typePosted: {FromWorker, 4 + 2 + MaxDetailLen, func(p *parser, _ *Decoder) Message {
		return &Posted{Seq: p.uint32(), Err: p.string(MaxDetailLen)}
	}},
	typeResend: {FromMonitor, 2 + MaxNameLen, func(p *parser, _ *Decoder) Message {
		return &Resend{Mount: p.string(MaxNameLen)}
	}},
	typeOnDisk: {FromMonitor, 2 + MaxNameLen + 2 + MaxDigestLen + 4 + 4, func(p *parser, _ *Decoder) Message {
		return &OnDisk{Mount: p.string(MaxNameLen), Digest: p.string(MaxDigestLen), UID: p.uint32(), GID: p.uint32()}
	}},
	typeUnchanged: {FromWorker, 2 + MaxNameLen + 8 + 2 + MaxDigestLen + 8, func(p *parser, _ *Decoder) Message {
		return &Unchanged{Mount: p.string(MaxNameLen), Generation: p.uint64(), Digest: p.string(MaxDigestLen), Size: p.uint64()}
	}},
}

// Begin (worker) starts a payload of Files files for mount Mount at
// Revision.
type Begin struct {
	Mount, Revision string
	Files           uint32
}

// File (worker) starts a file of the payload begun: its path in the
// mount, its permission bits and its size in bytes; Data frames carry its
// bytes.
type File struct {
	Path string
	Mode uint32
	Size uint64
}

// Data (worker) is a chunk of the current file's bytes, at most MaxChunk.
type Data struct {
	Bytes []byte
}

// Commit (worker) ends the payload begun.
type Commit struct{}

// State (worker) reports a source's health, as the feeds the mounts use
// see it — Err is empty while it can be read — and the newest revision
// read from it.
type State struct {
	Source, Err, Revision string
}

// MountState (worker) reports a mount's desired state: the worker's
// Generation of it, the Revision its payload comes from, Err when the
// payload cannot be built, the sources whose first snapshot has not come
// (Waiting) and the errors of those that cannot be read now (Stale). When
// the payload is ready and Generation new, the payload follows.
type MountState struct {
	Mount         string
	Generation    uint64
	Revision, Err string
	Waiting       []string
	Stale         []string
}

// HeldBack (worker) reports that a guard rail — max_value_size,
// max_mount_size or max_files — kept a mount's payload from being built.
type HeldBack struct {
	Mount, Guard, Reason, Revision string
}

// Log (worker) is one log record of the worker's: its slog level, message
// and attributes as key and value strings, one after the other. The
// monitor logs it with its own handler, which escapes it.
type Log struct {
	Level   int32
	Message string
	Attrs   []string
}

// Applied (worker) answers Apply Seq: Err is empty when the worker runs
// the configuration now, else why it keeps the one it ran.
type Applied struct {
	Seq uint32
	Err string
}

// Reread (worker) asks the monitor for the content of a credential file
// that a source reads again while it runs (config.RereadFiles); the
// monitor answers with a Credential, and reads only files the
// configuration names so.
type Reread struct {
	Name string
}

// Credential (monitor) answers a Reread: the file's content, or Err.
type Credential struct {
	Name  string
	Value []byte
	Err   string
}

// Input (monitor) passes the content of a file the configuration is made
// of: the configuration file itself and each file it names (credential,
// TLS and template files), which the worker may not read.
type Input struct {
	Name  string
	Value []byte
}

// Apply (monitor) makes the worker run the configuration of the Input
// named Config, with the Inputs sent since the last Apply as its files;
// the worker answers with Applied Seq.
type Apply struct {
	Seq    uint32
	Config string
}

// Resend (monitor) asks the worker for Mount's payload again: the monitor
// keeps none once written (Remote.Release), and needs it to repair drift.
// The worker builds it anew from its snapshots and sends it as any other
// (a MountState of a new generation, then the payload).
type Resend struct {
	Mount string
}

// OnDisk (monitor) gives the digest (projector.Payload.Digest) of the
// payload whose version Mount holds on disk: read from the version's
// manifest at a restart, or the payload the monitor released once
// written, for a worker started again. The worker sends Unchanged in
// place of the next payload of Mount if it has that digest — once: a
// later payload crosses whole. UID and GID are the owner the monitor gives
// the mount's files (reconcile.MountOwner, in the monitor's process: its
// own user where the mount names none), which the digest covers
// (ConfiguredDigest).
type OnDisk struct {
	Mount, Digest string
	UID, GID      uint32
}

// Unchanged (worker) stands for the payload of the MountState of Mount at
// Generation just sent: its digest is Digest, the one OnDisk gave, and
// its files hold Size bytes. The monitor takes it only at the digest it
// gave (Remote), so a worker can keep a mount at what the monitor itself
// wrote, and nothing else.
type Unchanged struct {
	Mount      string
	Generation uint64
	Digest     string
	Size       uint64
}

// Post (monitor) has the worker deliver a webhook (notify.Webhook):
// POST Body to URL with Header (name and value in turn), within Timeout;
// the worker answers with Posted Seq. A webhook's response is read by
// the worker, never by root.
type Post struct {
	Seq         uint32
	URL, Target string
	Header      []string
	Body        []byte
	Timeout     time.Duration
}

// Posted (worker) answers Post Seq: Err is empty when the webhook answered
// 2xx, else why the delivery failed.
type Posted struct {
	Seq uint32
	Err string
}

func (*Begin) msgType() byte      { return typeBegin }
func (*File) msgType() byte       { return typeFile }
func (*Data) msgType() byte       { return typeData }
func (*Commit) msgType() byte     { return typeCommit }
func (*State) msgType() byte      { return typeState }
func (*MountState) msgType() byte { return typeMountState }
func (*HeldBack) msgType() byte   { return typeHeldBack }
func (*Log) msgType() byte        { return typeLog }
func (*Applied) msgType() byte    { return typeApplied }
func (*Reread) msgType() byte     { return typeReread }
func (*Credential) msgType() byte { return typeCredential }
func (*Input) msgType() byte      { return typeInput }
func (*Apply) msgType() byte      { return typeApply }
func (*Post) msgType() byte       { return typePost }
func (*Posted) msgType() byte     { return typePosted }
func (*Resend) msgType() byte     { return typeResend }
func (*OnDisk) msgType() byte     { return typeOnDisk }
func (*Unchanged) msgType() byte  { return typeUnchanged }

func (m *Begin) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Mount, MaxNameLen)
	w.string(m.Revision, MaxRevisionLen)
	w.uint32(m.Files)
	return w.b, w.err
}

func (m *File) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Path, MaxPathLen)
	w.uint32(m.Mode)
	w.uint64(m.Size)
	return w.b, w.err
}

func (m *Data) put(b []byte) ([]byte, error) {
	if len(m.Bytes) > MaxChunk {
		return b, fmt.Errorf("%w: a chunk of %d bytes, more than %d", ErrMalformed, len(m.Bytes), MaxChunk)
	}
	return append(b, m.Bytes...), nil
}

func (*Commit) put(b []byte) ([]byte, error) { return b, nil }

func (m *State) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Source, MaxNameLen)
	w.string(m.Err, MaxDetailLen)
	w.string(m.Revision, MaxRevisionLen)
	return w.b, w.err
}

func (m *MountState) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Mount, MaxNameLen)
	w.uint64(m.Generation)
	w.string(m.Revision, MaxRevisionLen)
	w.string(m.Err, MaxDetailLen)
	w.list(m.Waiting, MaxNameLen)
	w.list(m.Stale, MaxDetailLen)
	return w.b, w.err
}

func (m *HeldBack) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Mount, MaxNameLen)
	w.string(m.Guard, MaxNameLen)
	w.string(m.Reason, MaxDetailLen)
	w.string(m.Revision, MaxRevisionLen)
	return w.b, w.err
}

func (m *Log) put(b []byte) ([]byte, error) {
	if len(m.Attrs)%2 != 0 {
		return b, fmt.Errorf("%w: %d attribute strings, not key and value pairs", ErrMalformed, len(m.Attrs))
	}
	w := writer{b: b}
	w.uint32(uint32(m.Level))
	w.string(m.Message, MaxDetailLen)
	w.list(m.Attrs, MaxDetailLen)
	return w.b, w.err
}

func (m *Applied) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.uint32(m.Seq)
	w.string(m.Err, MaxDetailLen)
	return w.b, w.err
}

func (m *Reread) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Name, MaxFileNameLen)
	return w.b, w.err
}

func (m *Credential) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Name, MaxFileNameLen)
	w.bytes(m.Value, MaxCredentialLen)
	w.string(m.Err, MaxDetailLen)
	return w.b, w.err
}

func (m *Input) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Name, MaxFileNameLen)
	w.bytes(m.Value, MaxInputLen)
	return w.b, w.err
}

func (m *Apply) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.uint32(m.Seq)
	w.string(m.Config, MaxFileNameLen)
	return w.b, w.err
}

func (m *Post) put(b []byte) ([]byte, error) {
	if len(m.Header)%2 != 0 {
		return b, fmt.Errorf("%w: %d header strings, not name and value pairs", ErrMalformed, len(m.Header))
	}
	w := writer{b: b}
	w.uint32(m.Seq)
	w.string(m.URL, MaxURLLen)
	w.string(m.Target, MaxDetailLen)
	w.list(m.Header, MaxHeaderLen)
	w.bytes(m.Body, MaxWebhookLen)
	w.uint64(uint64(max(m.Timeout, 0)))
	return w.b, w.err
}

func (m *Posted) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.uint32(m.Seq)
	w.string(m.Err, MaxDetailLen)
	return w.b, w.err
}

func (m *Resend) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Mount, MaxNameLen)
	return w.b, w.err
}

func (m *OnDisk) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Mount, MaxNameLen)
	w.string(m.Digest, MaxDigestLen)
	w.uint32(m.UID)
	w.uint32(m.GID)
	return w.b, w.err
}

func (m *Unchanged) put(b []byte) ([]byte, error) {
	w := writer{b: b}
	w.string(m.Mount, MaxNameLen)
	w.uint64(m.Generation)
	w.string(m.Digest, MaxDigestLen)
	w.uint64(m.Size)
	return w.b, w.err
}
