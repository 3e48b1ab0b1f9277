package command

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/roottest"
)

// mountinfo returns this process's mount table, to compare before and
// after a check: the host's namespace must never change.
func mountinfo(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

// candidateMount makes a mount directory holding live content and a
// candidate version directory with other content, and returns the view.
func candidateMount(t *testing.T, dir string) View {
	t.Helper()
	version := "..2026_11_23_00_00_00.000000001"
	for name, data := range map[string]string{"site.conf": "live", version + "/site.conf": "candidate"} {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ident := func(p string) fsutil.Ident {
		d, err := fsutil.OpenDir(p)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		id, err := fsutil.IdentOf(d)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	return View{MountDir: dir, Mount: ident(dir), Version: version, VersionIdent: ident(filepath.Join(dir, version))}
}

// TestViewShowsTheCandidateAtTheMountPath: the command reads the candidate
// through the mount's own path, runs in "/" (never in the candidate, whose
// entries a store writer chose), cannot write it, and the host's mount
// table is the same after the check — after success, failure, timeout and
// cancellation alike.
func TestViewShowsTheCandidateAtTheMountPath(t *testing.T) {
	roottest.Require(t)
	if err := NamespaceViews(); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "conf.d")
	v := candidateMount(t, dir)
	before := mountinfo(t)
	out, err := RunInView(context.Background(), Spec{Argv: []string{"sh", "-c", "cat " + dir + "/site.conf; echo; pwd; touch " + dir + "/x 2>&1 || echo read-only"}, UID: -1}, v)
	if err != nil {
		t.Fatalf("RunInView = %v (%s)", err, out)
	}
	if want := "candidate\n/\n"; !strings.HasPrefix(out+"\n", want) || !strings.Contains(out, "read-only") {
		t.Errorf("the check saw %q; want the candidate at %s, / as its working directory, and no write", out, dir)
	}
	if data, _ := os.ReadFile(filepath.Join(dir, "site.conf")); string(data) != "live" {
		t.Errorf("outside the check the mount holds %q; want live", data)
	}
	for name, run := range map[string]func() error{
		"failure": func() error {
			_, err := RunInView(context.Background(), Spec{Argv: []string{"sh", "-c", "exit 3"}, UID: -1}, v)
			return err
		},
		"timeout": func() error {
			_, err := RunInView(context.Background(), Spec{Argv: []string{"sh", "-c", "sleep 10 & sleep 10"}, Timeout: 100 * time.Millisecond, UID: -1}, v)
			return err
		},
		"killed": func() error {
			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(100*time.Millisecond, cancel)
			_, err := RunInView(ctx, Spec{Argv: []string{"sleep", "10"}, UID: -1}, v)
			return err
		},
	} {
		start := time.Now()
		if err := run(); err == nil {
			t.Errorf("%s: no error", name)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s took %v", name, d)
		}
	}
	if after := mountinfo(t); after != before {
		t.Errorf("the host's mount table changed:\nbefore:\n%s\nafter:\n%s", before, after)
	}
}

// TestViewRefusesAnotherDirectory: a view whose mount directory or
// candidate is not the one recorded is refused before the command runs.
func TestViewRefusesAnotherDirectory(t *testing.T) {
	roottest.Require(t)
	dir := filepath.Join(t.TempDir(), "conf.d")
	v := candidateMount(t, dir)
	marker := filepath.Join(t.TempDir(), "ran")
	for name, bad := range map[string]View{
		"mount":   {MountDir: v.MountDir, Mount: fsutil.Ident{FS: 1, Ino: 2}, Version: v.Version, VersionIdent: v.VersionIdent},
		"version": {MountDir: v.MountDir, Mount: v.Mount, Version: v.Version, VersionIdent: fsutil.Ident{FS: 1, Ino: 2}},
	} {
		_, err := RunInView(context.Background(), Spec{Argv: []string{"touch", marker}, UID: -1}, bad)
		if !errors.Is(err, fsutil.ErrReplaced) {
			t.Errorf("%s replaced: %v; want fsutil.ErrReplaced", name, err)
		}
	}
	if _, err := os.Stat(marker); err == nil {
		t.Error("the command ran over a replaced directory")
	}
}

// TestViewCannotBeRedirected is the review's second finding, played by a
// real unprivileged user who owns a parent of the mount directory and
// swaps it for a directory of their own, as fast as they can, while a
// check reads the mount's path again and again: the check sees the
// candidate every time (the review saw 5 of 5 checks run on the user's
// file).
func TestViewCannotBeRedirected(t *testing.T) {
	u := roottest.NewUser(t)
	app := filepath.Join(roottest.TempDir(t), "app")
	dir := filepath.Join(app, "etc", "certs")
	v := candidateMount(t, dir)
	u.Chown(t, app)
	if err := os.MkdirAll(filepath.Join(app, "evil", "certs"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(app, "evil", "certs", "site.conf"), []byte("attacker"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(app, "evil"), filepath.Join(app, "evil", "certs"), filepath.Join(app, "evil", "certs", "site.conf")} {
		u.Chown(t, p)
	}
	// The check starts, then the user swaps etc and evil as fast as they
	// can while it reads (both loops bounded).
	started := filepath.Join(t.TempDir(), "started")
	type result struct {
		out string
		err error
	}
	done := make(chan result, 1)
	go func() {
		out, err := RunInView(context.Background(), Spec{Argv: []string{"sh", "-c", "touch " + started + "; i=0; while [ $i -lt 300 ]; do cat " + dir + "/site.conf; echo; sleep 0.005; i=$((i+1)); done"}, UID: -1}, v)
		done <- result{out, err}
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(started); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the check never started")
		}
	}
	swapper := u.Command("sh", "-c", "cd "+app+" && end=$(($(date +%s) + 3)); n=0; while [ $(date +%s) -lt $end ]; do mv etc tmp && mv evil etc && mv etc evil && mv tmp etc; n=$((n+1)); done; echo $n")
	swaps, err := swapper.Output()
	if err != nil {
		t.Fatalf("the user's swaps: %v", err)
	}
	r := <-done
	out, err := r.out, r.err
	if err != nil {
		t.Fatalf("RunInView = %v (%s)", err, out)
	}
	t.Logf("%s swaps of the mount's parent during the check", strings.TrimSpace(string(swaps)))
	reads := strings.Fields(out)
	for i, got := range reads {
		if got != "candidate" {
			t.Fatalf("read %d of %d saw %q; want the candidate every time", i+1, len(reads), got)
		}
	}
	if len(reads) != 300 {
		t.Errorf("%d reads; want 300", len(reads))
	}
}

// TestCleanEnvironment: a command run as another user with ResetEnv gets
// that user's HOME and a fixed PATH, and none of kvmount's other variables
// (the review found root's whole environment in check_user's commands).
func TestCleanEnvironment(t *testing.T) {
	u := roottest.NewUser(t)
	t.Setenv("KVMOUNT_TEST_SECRET", "s3cret")
	t.Setenv("LANG", "C.UTF-8")
	out, err := Run(context.Background(), Spec{Argv: []string{"env"}, Dir: "/", UID: u.UID, GID: u.GID, ResetEnv: true, Env: []string{"KVMOUNT_MOUNT=m"}})
	if err != nil {
		t.Fatal(err)
	}
	env := map[string]string{}
	for line := range strings.SplitSeq(out, "\n") {
		k, v, _ := strings.Cut(line, "=")
		env[k] = v
	}
	if _, ok := env["KVMOUNT_TEST_SECRET"]; ok {
		t.Error("kvmount's environment reached the command")
	}
	if env["USER"] != u.Name || env["LOGNAME"] != u.Name || env["PATH"] != securePath || env["LANG"] != "C.UTF-8" || env["KVMOUNT_MOUNT"] != "m" {
		t.Errorf("environment %v", env)
	}
	if env["HOME"] == "/root" {
		t.Error("HOME is root's")
	}
}

func TestTail(t *testing.T) {
	nginx := `nginx: [emerg] invalid port in "127.0.0.1:99999" of the "listen" directive in /etc/nginx/conf.d/kvmount/site.conf:6
nginx: configuration file /etc/nginx/nginx.conf test failed
`
	for _, tt := range []struct{ in, want string }{
		{"", ""},
		{"one\n\n", "one"},
		{nginx, `nginx: [emerg] invalid port in "127.0.0.1:99999" of the "listen" directive in /etc/nginx/conf.d/kvmount/site.conf:6 | nginx: configuration file /etc/nginx/nginx.conf test failed`},
		{"a\x1b[31mred\x00\n", `a\x1b[31mred\x00`},
		{"csi\u009b2J evil\u202egnp\n", `csi\u009b2J evil\u202egnp`},
		{strings.Repeat("x", 300), strings.Repeat("x", 256)},
		{"first\n" + strings.Repeat("y", 250), strings.Repeat("y", 250)},
	} {
		if got := Tail(tt.in, 256); got != tt.want {
			t.Errorf("Tail(%.30q) = %q; want %q", tt.in, got, tt.want)
		}
	}
}
