package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestStoreBeyondTheLimits is the second review's ninth finding end to
// end: a mount limited to 5 files and 1 MiB whose prefix grows to 60
// values of 1.4 MB keeps its last content and is reported stale with why;
// kvmount reads the count and refuses, and holds none of the values (their
// memory is measured in BENCHMARKS.md, "Memory that follows the limits").
// Deep keys over max_files (the eighth finding) are held back too, with
// nothing written.
func TestStoreBeyondTheLimits(t *testing.T) {
	h := newHarness(t)
	h.writeConfig(h.mount("small", "/small/", "max_files = 5", `max_mount_size = "1MiB"`) + h.mount("deep", "/deep/", "max_files = 5"))
	h.put("/small/a", "1", "/deep/a", "1")
	h.start()
	h.waitContent(h.path("mnt", "small"), map[string]string{"a": "1"})
	h.waitContent(h.path("mnt", "deep"), map[string]string{"a": "1"})
	big := strings.Repeat("x", 1_400_000)
	for i := range 60 {
		h.put(fmt.Sprintf("/small/k%02d", i), big)
	}
	h.waitLog("mount stale", "mount=small", "holds more than the mounts following it may take")
	h.put("/deep/"+strings.Repeat("d/", 1000)+"a", "1", "/deep/"+strings.Repeat("d/", 1000)+"b", "2")
	h.waitLog("mount=deep", "max_files (5)")
	h.waitContent(h.path("mnt", "small"), map[string]string{"a": "1"})
	h.waitContent(h.path("mnt", "deep"), map[string]string{"a": "1"})
}

// TestServerChosenRevisionIsBounded is the second review's thirteenth
// finding: an HTTP source whose ETag is 300 KB made every notify command
// fail with "argument list too long" (KVMOUNT_REVISION). The revision is
// kept as a short hash, and the command runs.
func TestServerChosenRevisionIsBounded(t *testing.T) {
	etag := `"` + strings.Repeat("e", 300_000) + `"`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", etag)
		fmt.Fprint(w, `{"a": "1"}`)
	}))
	t.Cleanup(srv.Close)
	h := newBareHarness(t)
	h.sources = func() string {
		return fmt.Sprintf("[sources.main]\ntype = \"http\"\nurl = %q\nformat = \"json\"\npoll_interval = \"1s\"\n", srv.URL)
	}
	marks := sharedDir(t)
	h.writeConfig(h.mount("m", "") + fmt.Sprintf("  [[mount.notify]]\n  command = [\"sh\", \"-c\", \"echo $KVMOUNT_REVISION > %s/revision\"]\n", marks))
	h.start()
	h.waitContent(h.path("mnt", "m"), map[string]string{"a": "1"})
	waitFileContentPrefix(t, filepath.Join(marks, "revision"), "main@sha256:")
	if got, _ := os.ReadFile(filepath.Join(marks, "revision")); len(got) > 100 {
		t.Errorf("KVMOUNT_REVISION is %d bytes", len(got))
	}
}

// TestLogLinesEscapeOutsideText is part of the second review's eleventh
// finding: whatever a key name, a server's status line or a command's
// output holds — ESC, a C1 CSI (U+009B), a bidi override (U+202E), a
// newline that would forge a line — a log line, text or JSON, carries it
// escaped, never raw.
func TestLogLinesEscapeOutsideText(t *testing.T) {
	hostile := "key\x1b]0;pwned\a\r\nlevel=ERROR msg=forged \u009b2J \u202egnp.exe"
	for _, format := range []string{"text", "json"} {
		var b strings.Builder
		log := NewLogger(&b, format, slog.LevelDebug)
		log.Warn("rejected key", "key", hostile, "err", errors.New(hostile), "entries", []string{hostile})
		out := strings.TrimSuffix(b.String(), "\n")
		if strings.Count(out, "\n") != 0 {
			t.Errorf("%s: the line was split: %q", format, out)
		}
		for _, raw := range []string{"\x1b", "\a", "\r", "\u009b", "\u202e"} {
			if strings.Contains(out, raw) {
				t.Errorf("%s: the log line carries %q raw: %q", format, raw, out)
			}
		}
		if !strings.Contains(out, `\x1b`) && !strings.Contains(out, `\\x1b`) {
			t.Errorf("%s: the escape is not visible: %q", format, out)
		}
	}
}
