package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
)

// TestStateDirIsRootsAlone is the second review's sixth finding, as a real
// unprivileged user: a state_dir the user owns, one whose parent they own,
// and a symlink to a victim directory are each refused by kvmount check
// (exit 1) and by kvmount run, with an error that names why — and nothing
// is chmodded, locked or written there, the victim included.
func TestStateDirIsRootsAlone(t *testing.T) {
	u := roottest.NewUser(t)
	base := roottest.TempDir(t)
	theirs := filepath.Join(base, "theirs")
	parent := filepath.Join(base, "parent")
	victim := filepath.Join(base, "victim")
	for _, d := range []string{theirs, parent, filepath.Join(parent, "state"), victim} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	u.Chown(t, theirs)
	u.Chown(t, parent)
	if err := os.Symlink(victim, filepath.Join(base, "link")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, dir, want string }{
		{"owned by the user", theirs, "is owned by user " + u.Name},
		{"a parent owned by the user", filepath.Join(parent, "state"), parent + " is owned by user " + u.Name},
		{"a symlink to a victim", filepath.Join(base, "link"), "is a symlink"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := writeFile(t, "k.toml", fmt.Sprintf("state_dir = %q\n[admin]\naddress = \"\"\nsocket = \"\"\n", tc.dir))
			code, _, errOut := runCmd("check", "-config", cfg)
			if code != 1 || !strings.Contains(errOut, "state_dir") || !strings.Contains(errOut, tc.want) {
				t.Errorf("kvmount check = %d, %q; want 1 and %q", code, errOut, tc.want)
			}
			cmd := exec.Command(kvmountBin, "run", "-config", cfg)
			done := make(chan struct{})
			var out []byte
			var err error
			go func() { out, err = cmd.CombinedOutput(); close(done) }()
			select {
			case <-done:
			case <-time.After(waitTimeout):
				cmd.Process.Kill()
				<-done
				t.Fatal("kvmount run did not refuse the state_dir")
			}
			if err == nil || !strings.Contains(string(out), tc.want) {
				t.Errorf("kvmount run = %v, %s; want a refusal naming %q", err, out, tc.want)
			}
			for _, d := range []string{tc.dir, victim} {
				info, err := os.Stat(d)
				if err != nil {
					t.Fatal(err)
				}
				if info.Mode().Perm() != 0o755 {
					t.Errorf("%s was chmodded to %v", d, info.Mode().Perm())
				}
				for _, f := range []string{"kvmount.lock", "mounts.json"} {
					if _, err := os.Lstat(filepath.Join(d, f)); err == nil {
						t.Errorf("kvmount wrote %s into %s", f, d)
					}
				}
			}
		})
	}
}

// TestStatusEscapesOutsideText is part of the second review's eleventh
// finding: kvmount status prints what /status says — version names found
// on disk, errors that carry key names, servers' status lines, check
// output — escaped, so that a forged version name with a terminal title
// sequence, a carriage return and a new line, or a bidi override, neither
// drives the operator's terminal nor forges a line.
func TestStatusEscapesOutsideText(t *testing.T) {
	roottest.Require(t)
	base := roottest.TempDir(t)
	sock := filepath.Join(base, "run", "kvmount.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	hostile := "..2026_11_22_01_02_03.1\x1b]0;pwned\a\r\nother current ..x \u009b2J \u202egnp"
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	body, _ := json.Marshal(map[string]any{"ready": false, "mounts": map[string]any{"app": map[string]any{"state": "failed", "version": hostile, "last_error": "key " + hostile}},
		"sources": map[string]any{"main": map[string]any{"up": false, "last_error": "HTTP 500 " + hostile}}})
	go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write(body) }))
	cfg := writeFile(t, "k.toml", fmt.Sprintf("state_dir = %q\n[admin]\naddress = \"\"\nsocket = %q\n", filepath.Join(base, "state"), sock))
	code, out, errOut := runCmd("status", "-config", cfg)
	if code != 1 {
		t.Errorf("kvmount status = %d; want 1 (%s)", code, errOut)
	}
	if strings.Count(strings.TrimSpace(out), "\n") != 1 {
		t.Errorf("kvmount status printed %d lines; want 2 (the mount, the source):\n%s", strings.Count(out, "\n"), out)
	}
	for _, raw := range []string{"\x1b", "\a", "\r", "\u009b", "\u202e"} {
		if strings.Contains(out, raw) {
			t.Errorf("kvmount status printed %q raw:\n%q", raw, out)
		}
	}
}
