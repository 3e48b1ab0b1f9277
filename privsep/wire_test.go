package privsep

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/projector"
)

// encode returns the frames of msgs.
func encode(t testing.TB, msgs ...Message) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := NewEncoder(&buf)
	for _, m := range msgs {
		if err := e.Encode(m); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Flush(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// payloadFrames returns the frames of a payload for mount of files.
func payloadFrames(t testing.TB, mount, revision string, files map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := NewEncoder(&buf)
	if err := e.Encode(&Begin{Mount: mount, Revision: revision, Files: uint32(len(files))}); err != nil {
		t.Fatal(err)
	}
	for p, data := range files {
		if err := e.EncodeFile(p, 0o644, []byte(data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Encode(&Commit{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Flush(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// assemble decodes stream and feeds an assembler for mounts with it; it
// returns the payloads completed and the first error.
func assemble(stream []byte, mounts map[string]MountLimits) ([]*Payload, error) {
	d := NewDecoder(bytes.NewReader(stream), FromWorker)
	a := NewAssembler(mounts, nil)
	var out []*Payload
	for {
		m, err := d.Decode()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		switch m.(type) {
		case *Begin, *File, *Data, *Commit:
		default:
			continue
		}
		p, err := a.Add(m)
		if err != nil {
			return out, err
		}
		if p != nil {
			out = append(out, p)
		}
	}
}

var testMounts = map[string]MountLimits{
	"app":   {MaxValueSize: 1 << 20, MaxSize: 4 << 20, MaxFiles: 100},
	"small": {MaxValueSize: 10, MaxSize: 8192, MaxFiles: 3},
}

// TestRoundTrip: every message survives encoding, a file larger than a
// chunk arrives whole, and a payload is assembled as it was sent.
func TestRoundTrip(t *testing.T) {
	big := strings.Repeat("x", 3*MaxChunk+17)
	fromWorker := []Message{
		&State{Source: "main", Err: "", Revision: "42"},
		&MountState{Mount: "app", Generation: 7, Revision: "main@42", Err: "e", Waiting: []string{"a", "b"}, Stale: []string{"source \"c\": down"}},
		&HeldBack{Mount: "app", Guard: "max_files", Reason: "too many", Revision: "main@43"},
		&Log{Level: -4, Message: "m", Attrs: []string{"mount", "app", "n", "3"}},
		&Applied{Seq: 9, Err: "no"},
		&Reread{Name: "/etc/kvmount/token"},
		&Posted{Seq: 3, Err: "webhook 127.0.0.1:8080: 503 Service Unavailable"},
		&Unchanged{Mount: "app", Generation: 7, Digest: strings.Repeat("ab", 32), Size: 7500},
	}
	fromMonitor := []Message{
		&Credential{Name: "/etc/kvmount/token", Value: []byte("s3cret"), Err: ""},
		&Input{Name: "/etc/kvmount/kvmount.toml", Value: []byte(big)},
		&Apply{Seq: 9, Config: "/etc/kvmount/kvmount.toml"},
		&Post{Seq: 3, URL: "http://127.0.0.1:8080/hook", Target: "127.0.0.1:8080", Header: []string{"Authorization", "Bearer t"}, Body: []byte(`{"mount":"app"}`), Timeout: 10 * time.Second},
		&Resend{Mount: "app"},
		&OnDisk{Mount: "app", Digest: strings.Repeat("ab", 32), UID: 0, GID: 998},
	}
	for _, dir := range []struct {
		from Side
		msgs []Message
	}{{FromWorker, fromWorker}, {FromMonitor, fromMonitor}} {
		d := NewDecoder(bytes.NewReader(encode(t, dir.msgs...)), dir.from)
		for _, want := range dir.msgs {
			got, err := d.Decode()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("got %+v; want %+v", got, want)
			}
		}
		// The other side does not send these.
		other := FromMonitor - dir.from
		if _, err := NewDecoder(bytes.NewReader(encode(t, dir.msgs[0])), other).Decode(); !errors.Is(err, ErrMalformed) || !strings.Contains(err.Error(), "is not the "+other.String()+"'s to send") {
			t.Errorf("a %T from the %s: %v", dir.msgs[0], other, err)
		}
	}
	stream := append(encode(t, fromWorker...), payloadFrames(t, "app", "rev:7", map[string]string{"a": "1", "dir/b": big, "empty": ""})...)
	payloads, err := assemble(stream, testMounts)
	if err != nil {
		t.Fatal(err)
	}
	if len(payloads) != 1 {
		t.Fatalf("%d payloads", len(payloads))
	}
	p := payloads[0]
	if p.Mount != "app" || p.Revision != "rev:7" || len(p.Files) != 3 || string(p.Files["dir/b"].Data) != big ||
		string(p.Files["a"].Data) != "1" || p.Files["a"].Mode != 0o644 || len(p.Files["empty"].Data) != 0 {
		t.Errorf("payload %s %s with %d files", p.Mount, p.Revision, len(p.Files))
	}
}

// frame returns one frame of type t with body, for what the encoder would
// not write.
func frame(t byte, body []byte) []byte {
	hdr := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	return append(append(hdr, t), body...)
}

// fileFrame is a File frame for any path, mode and size.
func fileFrame(p string, mode uint32, size uint64) []byte {
	b := binary.BigEndian.AppendUint16(nil, uint16(len(p)))
	b = append(b, p...)
	b = binary.BigEndian.AppendUint32(b, mode)
	return frame(typeFile, binary.BigEndian.AppendUint64(b, size))
}

// TestDecoderReady: Ready tells whether the next Decode has its whole
// frame buffered — after one read, between the frames of one write, and
// not when only part of a frame is in.
func TestDecoderReady(t *testing.T) {
	two := encode(t, &State{Source: "main", Revision: "1"}, &State{Source: "main", Revision: "2"})
	third := encode(t, &State{Source: "main", Revision: "3"})
	r, w := io.Pipe()
	d := NewDecoder(r, FromWorker)
	if d.Ready() {
		t.Error("Ready before anything was read")
	}
	go func() {
		w.Write(two)                  // one read: both frames
		w.Write(third[:len(third)-1]) // a frame cut short
		w.Write(third[len(third)-1:])
		w.Close()
	}()
	for i, want := range []bool{true, false} {
		if _, err := d.Decode(); err != nil {
			t.Fatal(err)
		}
		if got := d.Ready(); got != want {
			t.Errorf("after frame %d, Ready = %v; want %v", i+1, got, want)
		}
	}
	// The third frame arrives in two reads: Decode waits for its end.
	if m, err := d.Decode(); err != nil || m.(*State).Revision != "3" {
		t.Fatalf("third frame: %+v, %v", m, err)
	}
	if d.Ready() {
		t.Error("Ready at the end of the stream")
	}
}

// TestHostileWorker: what a compromised worker may send is refused, with
// an error that says why, and no payload comes of it.
func TestHostileWorker(t *testing.T) {
	begin := func(mount string, files uint32) []byte {
		return encode(t, &Begin{Mount: mount, Revision: "r1", Files: files})
	}
	join := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	commit := encode(t, &Commit{})
	// 10⁶ files, of which the mount's max_files (100) are announced.
	many := begin("app", 100)
	for i := range 1_000_000 {
		many = append(many, fileFrame(fmt.Sprintf("f%d", i), 0o644, 0)...)
	}
	for _, tc := range []struct {
		name   string
		stream []byte
		want   error
		says   string
	}{
		{"../ path", join(begin("app", 1), fileFrame("../etc/passwd", 0o644, 0), commit), ErrRefused, `invalid path "../etc/passwd"`},
		{"nested ../", join(begin("app", 1), fileFrame("a/../../x", 0o644, 0), commit), ErrRefused, "must not contain '..'"},
		{"absolute path", join(begin("app", 1), fileFrame("/etc/cron.d/x", 0o644, 0), commit), ErrRefused, "must be a relative path"},
		{"..data", join(begin("app", 1), fileFrame("..data", 0o644, 0), commit), ErrRefused, "must not start with '..'"},
		{"unclean path", join(begin("app", 1), fileFrame("a//b", 0o644, 0), commit), ErrRefused, "is not clean"},
		{"setuid mode", join(begin("app", 1), fileFrame("a", 0o4755, 0), commit), ErrRefused, "more than permission bits"},
		{"10⁶ files announced", begin("app", 1_000_000), ErrRefused, "a payload of 1000000 files, more than max_files (100)"},
		{"10⁶ files sent", many, ErrRefused, `file "f100" past the 100 announced`},
		{"a file twice", join(begin("app", 2), fileFrame("f", 0o644, 0), fileFrame("f", 0o644, 0), commit), ErrRefused, "given twice"},
		{"a file below a file", join(begin("app", 2), fileFrame("f", 0o644, 0), fileFrame("f/g", 0o644, 0), commit), ErrRefused, `below the file "f"`},
		{"deep directories", join(begin("small", 1), fileFrame("a/b/c/d", 0o644, 0), commit), ErrRefused, "more than max_files (3)"},
		{"a 2 GiB length", join(begin("app", 1), binary.BigEndian.AppendUint32(nil, 2<<30), []byte{typeData}), ErrMalformed, "a body of 2147483648 bytes"},
		{"a 2 GiB file", join(begin("app", 1), fileFrame("f", 0o644, 2<<30)), ErrRefused, "exceeds max_value_size (1048576 bytes)"},
		{"more bytes than announced", join(begin("small", 1), fileFrame("a", 0o644, 2), frame(typeData, []byte("abc"))), ErrRefused, "more bytes than the 2 announced"},
		{"commit before the bytes", join(begin("small", 1), fileFrame("a", 0o644, 2), commit), ErrRefused, "committed before"},
		{"fewer files than announced", join(begin("app", 2), fileFrame("a", 0o644, 0), commit), ErrRefused, "1 files of the 2 announced"},
		{"an unknown mount", join(begin("root", 1), fileFrame("a", 0o644, 0), commit), ErrRefused, `mount "root", which the configuration does not have`},
		{"a revision with controls", encode(t, &Begin{Mount: "app", Revision: "r\x1b[2J", Files: 0}), ErrRefused, "not printable ASCII"},
		{"a payload in a payload", join(begin("app", 1), begin("app", 1)), ErrRefused, "begun before"},
		{"bytes outside a file", frame(typeData, []byte("x")), ErrRefused, "outside a file"},
		{"a truncated frame", join(begin("app", 1), fileFrame("a", 0o644, 5))[:30], ErrTruncated, "cut short"},
		{"a truncated header", []byte{0, 0, 0}, ErrTruncated, "in a header"},
		{"an unknown type", frame(99, nil), ErrMalformed, "unknown type 99"},
		{"bytes left over", frame(typeCommit, []byte{1}), ErrMalformed, "at most 0"},
		{"a string past its frame", frame(typeBegin, []byte{0, 200, 'a'}), ErrMalformed, "where 1 remain"},
		{"a list too long", frame(typeMountState, append(append(make([]byte, 2+8+2+2), 0, 0), 0xff, 0xff)), ErrMalformed, "a list of 65535 strings, more than 64"},
		{"odd log attributes", frame(typeLog, append(make([]byte, 4+2), 0, 1, 0, 0)), ErrMalformed, "not key and value pairs"},
		{"a monitor's message", encode(t, &Input{Name: "x"}), ErrMalformed, "not the worker's to send"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			payloads, err := assemble(tc.stream, testMounts)
			if len(payloads) != 0 {
				t.Errorf("payloads %v came of it", payloads)
			}
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("error %v; want %v saying %q", err, tc.want, tc.says)
			}
		})
	}
	// Past max_mount_size, counting the directory each file needs.
	stream := payloadFrames(t, "small", "r", map[string]string{"d/a": "0123456789", "e": "x"})
	if _, err := assemble(stream, map[string]MountLimits{"small": {MaxSize: projector.DirectoryCost() + 10}}); !errors.Is(err, projector.ErrMountTooLarge) {
		t.Errorf("a payload past max_mount_size: %v", err)
	}
}

// TestAssemblerStartsAfresh: after a refusal, the next payload is taken
// whole, with nothing of the refused one.
func TestAssemblerStartsAfresh(t *testing.T) {
	a := NewAssembler(testMounts, nil)
	if _, err := a.Add(&Begin{Mount: "app", Revision: "1", Files: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Add(&File{Path: "kept-out", Mode: 0o644}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Add(&File{Path: "../x", Mode: 0o644}); !errors.Is(err, ErrRefused) {
		t.Fatalf("../x: %v", err)
	}
	for _, m := range []Message{&Begin{Mount: "app", Revision: "2", Files: 1}, &File{Path: "a", Mode: 0o600, Size: 1}, &Data{Bytes: []byte("z")}} {
		if _, err := a.Add(m); err != nil {
			t.Fatal(err)
		}
	}
	p, err := a.Add(&Commit{})
	if err != nil || p == nil || len(p.Files) != 1 || string(p.Files["a"].Data) != "z" || p.Revision != "2" {
		t.Fatalf("%+v, %v", p, err)
	}
}

// FuzzDecode feeds any bytes to the decoder and an assembler: nothing
// panics, and every payload that comes out keeps its mount's rules.
func FuzzDecode(f *testing.F) {
	f.Add(payloadFrames(f, "app", "r1", map[string]string{"a": "1", "d/b": "22"}))
	f.Add(payloadFrames(f, "small", "r2", map[string]string{"x": "0123456789"}))
	f.Add(encode(f, &State{Source: "s", Err: "d"}, &MountState{Mount: "app", Waiting: []string{"s"}}, &Log{Message: "m", Attrs: []string{"k", "v"}}))
	f.Add(fileFrame("../x", 0o644, 1))
	f.Add(encode(f, &Posted{Seq: 1, Err: "webhook: 500"}, &Applied{Seq: 2}))
	f.Fuzz(func(t *testing.T, stream []byte) {
		payloads, _ := assemble(stream, testMounts)
		for _, p := range payloads {
			limits, ok := testMounts[p.Mount]
			if !ok {
				t.Fatalf("a payload for mount %q", p.Mount)
			}
			opts := projector.Options{MaxValueSize: limits.MaxValueSize, MaxSize: limits.MaxSize, MaxFiles: limits.MaxFiles}
			if err := projector.CheckLimits(p.Mount, p.Files, opts); err != nil {
				t.Fatal(err)
			}
			for name, file := range p.Files {
				if clean, err := projector.CleanPath(name); err != nil || clean != name {
					t.Fatalf("path %q: %v", name, err)
				}
				if int64(len(file.Data)) > limits.MaxValueSize || file.Mode&^0o777 != 0 {
					t.Fatalf("file %q: %d bytes, mode %v", name, len(file.Data), file.Mode)
				}
			}
		}
	})
}

// TestFramesAllocateNothingOfTheirOwn checks that a file's frames cost the
// encoder no allocation and the decoder only the path it returns: a
// frame's own garbage (its header, its parser, its message), made between
// the payloads the monitor keeps, left one kept object in each of
// thousands of spans, which the Go heap can neither move nor return
// (BenchmarkAssemble: 25.5 MiB of spans in use for 18.5 MiB of payloads,
// 17.2 without).
func TestFramesAllocateNothingOfTheirOwn(t *testing.T) {
	data := bytes.Repeat([]byte("v"), 75)
	e := NewEncoder(io.Discard)
	if n := testing.AllocsPerRun(100, func() {
		if err := e.EncodeFile("dir/key", 0o644, data); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("EncodeFile: %v allocations a file", n)
	}
	if e.data.Bytes != nil {
		t.Error("the encoder keeps the caller's bytes after EncodeFile")
	}

	const files = 100
	var stream bytes.Buffer
	e = NewEncoder(&stream)
	for i := range files {
		if err := e.EncodeFile(fmt.Sprintf("key-%03d", i), 0o644, data); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Flush(); err != nil {
		t.Fatal(err)
	}
	r := bytes.NewReader(stream.Bytes())
	d := NewDecoder(r, FromWorker)
	n := testing.AllocsPerRun(10, func() {
		r.Reset(stream.Bytes())
		d.r.Reset(r)
		for range files {
			f, err := d.Decode()
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := f.(*File); !ok {
				t.Fatalf("%T, not a *File", f)
			}
			if m, err := d.Decode(); err != nil || len(m.(*Data).Bytes) != len(data) {
				t.Fatalf("%v, %v", m, err)
			}
		}
	})
	// The path is a string of its own, which the payload keeps.
	if n > files {
		t.Errorf("Decode: %v allocations for %d files", n, files)
	}

	// The messages are the decoder's own: the next call overwrites them.
	r.Reset(stream.Bytes())
	d.r.Reset(r)
	first, _ := d.Decode()
	path := first.(*File).Path
	_, _ = d.Decode()
	second, _ := d.Decode()
	if first != second || path != "key-000" || second.(*File).Path != "key-001" {
		t.Errorf("got %q then %q from %p and %p", path, second.(*File).Path, first, second)
	}
}
