package privsep

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"testing"

	"github.com/kvmount/kvmount/projector"
)

// readWriter joins a reader and a writer into one link.
type readWriter struct {
	io.Reader
	io.Writer
}

// TestRereadGivenUpIsForgotten: a credential read that cannot reach the
// monitor leaves nothing waiting behind it.
func TestRereadGivenUpIsForgotten(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	defer w.Close()
	l := NewMonitorLink(readWriter{Writer: w})
	if _, _, err := l.Files().Read("/etc/kvmount/token", 1024); err == nil {
		t.Fatal("a read over a closed socket succeeded")
	}
	if len(l.rereads.waiting) != 0 || len(l.rereads.asked) != 0 {
		t.Errorf("waiting after the read gave up: %v %v", l.rereads.waiting, l.rereads.asked)
	}
}

// writeCounter counts the writes made to it.
type writeCounter struct{ writes int }

func (w *writeCounter) Write(p []byte) (int, error) {
	w.writes++
	return len(p), nil
}

// TestLinkWritesAnUpdateAtOnce: what a worker sends for one update — the
// sources' states it queued, the mount's state and its payload — reaches
// the monitor in one write, so that it wakes once for it.
func TestLinkWritesAnUpdateAtOnce(t *testing.T) {
	out := &writeCounter{}
	l := NewMonitorLink(readWriter{Writer: out})
	if err := l.Queue(&State{Source: "main", Revision: "7"}); err != nil {
		t.Fatal(err)
	}
	st := &MountState{Mount: "app", Generation: 3, Revision: "main@7"}
	if err := l.QueuePayload(st, projector.Payload{"a": {Data: []byte("1"), Mode: 0o644}, "b": {Data: []byte("2"), Mode: 0o600}}); err != nil {
		t.Fatal(err)
	}
	if out.writes != 0 {
		t.Errorf("%d writes before the flush", out.writes)
	}
	if err := l.Flush(); err != nil {
		t.Fatal(err)
	}
	if out.writes != 1 {
		t.Errorf("%d writes for one update; want 1", out.writes)
	}
}

// TestLogHandlerSaysWhatItCuts: log attributes past 32 pairs are counted
// as attrs_dropped.
func TestLogHandlerSaysWhatItCuts(t *testing.T) {
	var buf bytes.Buffer
	h := NewMonitorLink(readWriter{Writer: &buf}).Handler(slog.LevelInfo)
	var args []any
	for i := range 40 {
		args = append(args, fmt.Sprintf("k%d", i), i)
	}
	slog.New(h).Info("many", args...)
	m, err := NewDecoder(&buf, FromWorker).Decode()
	if err != nil {
		t.Fatal(err)
	}
	attrs := m.(*Log).Attrs
	if len(attrs) != MaxListLen || !slices.Equal(attrs[len(attrs)-2:], []string{"attrs_dropped", "9"}) {
		t.Errorf("%d attributes, ending %q; want %d ending attrs_dropped 9", len(attrs), attrs[len(attrs)-2:], MaxListLen)
	}
}
