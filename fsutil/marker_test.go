package fsutil

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

// TestHelperProcess is the body of roottest.User.Helper's commands.
func TestHelperProcess(t *testing.T) {
	roottest.RunHelper(map[string]func() error{
		// Set the marker on $DIR, a directory the user owns.
		"set-marker": func() error {
			return unix.Setxattr(os.Getenv("DIR"), MarkerAttr, []byte(os.Getenv("TOKEN")), 0)
		},
		// Read the marker of $DIR, printing it.
		"read-marker": func() error {
			buf := make([]byte, 64)
			n, err := unix.Getxattr(os.Getenv("DIR"), MarkerAttr, buf)
			if err != nil {
				return err
			}
			os.Stdout.Write(buf[:n])
			return nil
		},
	})
}

// markedDir makes a directory under base with the marker token.
func markedDir(t *testing.T, path, token string) *os.File {
	t.Helper()
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	d, err := OpenDir(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	if token != "" {
		if err := SetMarker(d, token); err != nil {
			t.Fatalf("SetMarker: %v", err)
		}
	}
	return d
}

// TestRecognize walks Recognize's rules with real directories and
// markers: the marker wins over a changed identity (a renumbered file
// system), the identity over a missing or unrecorded marker, and a
// directory that has neither is refused — as unrecognisable only when its
// file system changed and it keeps no marker.
func TestRecognize(t *testing.T) {
	roottest.Require(t)
	base := t.TempDir()
	mine := markedDir(t, filepath.Join(base, "mine"), "0123456789abcdef0123456789abcdef")
	id, err := IdentOf(mine)
	if err != nil {
		t.Fatal(err)
	}
	other := markedDir(t, filepath.Join(base, "other"), "fedcba9876543210fedcba9876543210")
	bare := markedDir(t, filepath.Join(base, "bare"), "")
	renumbered := Ident{FS: id.FS + 1, Ino: id.Ino}
	elsewhere := Ident{FS: id.FS, Ino: id.Ino + 1_000_000}
	tests := []struct {
		name             string
		d                *os.File
		o                Owned
		replaced, unsure bool
	}{
		{name: "nothing recorded", d: bare},
		{name: "the marker, its file system renumbered", d: mine, o: Owned{Ident: &renumbered, Marker: "0123456789abcdef0123456789abcdef"}},
		{name: "the marker, no identity recorded", d: mine, o: Owned{Marker: "0123456789abcdef0123456789abcdef"}},
		{name: "the identity, no marker recorded", d: mine, o: Owned{Ident: &id}},
		{name: "the identity, another marker recorded", d: mine, o: Owned{Ident: &id, Marker: "ffffffffffffffffffffffffffffffff"}},
		{name: "another kvmount marker", d: other, o: Owned{Ident: &renumbered, Marker: "0123456789abcdef0123456789abcdef"}, replaced: true},
		{name: "another marker, none recorded", d: other, o: Owned{Ident: &renumbered}, replaced: true},
		{name: "no marker where one was set", d: bare, o: Owned{Ident: &renumbered, Marker: "0123456789abcdef0123456789abcdef"}, replaced: true},
		{name: "no marker, none recorded, another file system", d: bare, o: Owned{Ident: &renumbered}, replaced: true, unsure: true},
		{name: "no marker, none recorded, same file system", d: bare, o: Owned{Ident: &elsewhere}, replaced: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Recognize(tt.d, tt.d.Name(), tt.o)
			if errors.Is(err, ErrReplaced) != tt.replaced || errors.Is(err, ErrUnrecognized) != tt.unsure {
				t.Fatalf("Recognize = %v; want replaced %v, unrecognized %v", err, tt.replaced, tt.unsure)
			}
			if err != nil && !strings.Contains(err.Error(), tt.d.Name()) {
				t.Errorf("the error does not name the path: %v", err)
			}
		})
	}
}

// TestMarkerOutOfAUsersReach: a real unprivileged user can neither give a
// directory of their own kvmount's marker (so a directory they swap in
// never passes for kvmount's) nor read the marker of kvmount's (so they
// cannot learn it) — the kernel keeps the trusted namespace to
// CAP_SYS_ADMIN on every file system.
func TestMarkerOutOfAUsersReach(t *testing.T) {
	u := roottest.NewUser(t)
	base := roottest.TempDir(t)
	theirs := filepath.Join(base, "theirs")
	if err := os.Mkdir(theirs, 0o755); err != nil {
		t.Fatal(err)
	}
	u.Chown(t, theirs)
	if out, err := u.Helper(t, "set-marker", "DIR="+theirs, "TOKEN=0123456789abcdef0123456789abcdef").CombinedOutput(); err == nil {
		t.Fatalf("a user set the marker on their directory: %s", out)
	} else if !strings.Contains(string(out), "operation not permitted") {
		t.Errorf("setting the marker as a user failed otherwise than with EPERM: %s", out)
	}
	d, err := OpenDir(theirs)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if got, err := ReadMarker(d); err != nil || got != "" {
		t.Errorf("ReadMarker of the user's directory = %q, %v; want none", got, err)
	}
	mine := markedDir(t, filepath.Join(base, "mine"), "0123456789abcdef0123456789abcdef")
	if got, err := ReadMarker(mine); err != nil || got != "0123456789abcdef0123456789abcdef" {
		t.Fatalf("ReadMarker = %q, %v", got, err)
	}
	if out, err := u.Helper(t, "read-marker", "DIR="+mine.Name()).CombinedOutput(); err == nil || strings.Contains(string(out), "0123456789abcdef") {
		t.Errorf("a user read kvmount's marker: %v: %s", err, out)
	}
}

// TestNoMarkerWhereTheFileSystemKeepsNone: a file system without trusted
// attributes (procfs here) is ErrNoMarker, for reading and setting alike,
// not another error.
func TestNoMarkerWhereTheFileSystemKeepsNone(t *testing.T) {
	roottest.Require(t)
	d, err := os.Open("/proc/self")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := ReadMarker(d); !errors.Is(err, ErrNoMarker) {
		t.Errorf("ReadMarker on procfs = %v; want ErrNoMarker", err)
	}
	if err := SetMarker(d, "0123456789abcdef0123456789abcdef"); !errors.Is(err, ErrNoMarker) {
		t.Errorf("SetMarker on procfs = %v; want ErrNoMarker", err)
	}
}
