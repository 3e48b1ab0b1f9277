// Package command runs the external programs kvmount starts — a mount's
// check_command and the notifier's command kind — the same way: an argv
// without a shell, a timeout, optionally another user, extra environment,
// and the first few KiB of output kept for the debug log (a program may
// print the secret values it reads).
package command

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvmount/kvmount/untrusted"
)

// OutputLimit is how much of a command's output (stdout and stderr
// together) is kept, in bytes.
const OutputLimit = 4 << 10

// waitDelay bounds how long Run waits for the output pipes after the
// command was killed (a child it started may hold them).
const waitDelay = time.Second

// ErrTimeout is returned (wrapped) by Run when the command outlived its
// timeout and was killed.
var ErrTimeout = errors.New("timed out")

// ErrKilled is returned (wrapped) by Run when its context ended — kvmount
// is stopping — and the command was killed.
var ErrKilled = errors.New("killed: kvmount is stopping")

// Spec describes one run of a command.
type Spec struct {
	// Argv is the program and its arguments; no shell is involved.
	Argv []string
	// Dir is the working directory; "" is "/". Never a directory whose
	// entries someone other than root chooses — a mount's: a program
	// that looks in its working directory (python -c, git, make, node,
	// perl with . in @INC) would run a store writer's content.
	Dir string
	// Env holds NAME=value pairs added to kvmount's environment, or with
	// ResetEnv to the clean one.
	Env []string
	// ResetEnv gives the command a clean environment instead of
	// kvmount's, as sudo's env_reset does: PATH, HOME, USER, LOGNAME and
	// SHELL of the user it runs as, and kvmount's LANG, LANGUAGE, LC_*
	// and TZ; then Env.
	ResetEnv bool
	// Timeout kills the command after this long; zero means no limit
	// beyond the context.
	Timeout time.Duration
	// UID and GID, when UID ≥ 0, run the command as that user and group.
	UID, GID int
}

// Run runs s and returns its output (at most OutputLimit bytes, trimmed)
// and nil when it exits 0. Otherwise the error says why: the exit status
// (an *exec.ExitError), ErrTimeout after s.Timeout, ErrKilled when ctx
// ended, or why it could not start. Cancelling ctx kills the command.
func Run(ctx context.Context, s Spec) (output string, err error) {
	if len(s.Argv) == 0 || s.Argv[0] == "" {
		return "", errors.New("command: no program")
	}
	parent := ctx
	if s.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.Timeout)
		defer cancel()
	}
	cmd := exec.CommandContext(ctx, s.Argv[0], s.Argv[1:]...)
	cmd.Dir = s.Dir
	if cmd.Dir == "" {
		cmd.Dir = "/"
	}
	switch {
	case s.ResetEnv:
		cmd.Env = append(cleanEnv(s.UID), s.Env...)
	case len(s.Env) > 0:
		cmd.Env = append(os.Environ(), s.Env...)
	}
	// Its own process group, killed whole: a check that forks leaves
	// nothing running behind it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if s.UID >= 0 {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(s.UID), Gid: uint32(s.GID), Groups: supplementaryGroups(s.UID)}
	}
	var out limitedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = waitDelay
	err = cmd.Run()
	output = strings.TrimSpace(out.String())
	switch {
	case err == nil:
		return output, nil
	case parent.Err() != nil:
		return output, ErrKilled
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return output, fmt.Errorf("%w after %v", ErrTimeout, s.Timeout)
	}
	return output, err
}

// Tail returns the last lines of a command's output, joined with " | ",
// at most limit bytes (a longer last line is cut at its end): what a
// failed check shows of why. Each line is escaped (untrusted.Escape): the
// output is outside text. nginx
// -t, for one, prints its reason on the line before its last ("nginx:
// [emerg] invalid port ... in site.conf:6", then "nginx: configuration
// file ... test failed").
func Tail(output string, limit int) string {
	lines := strings.Split(strings.TrimSpace(output), "\n")
	var kept []string
	size := 0
	for i := len(lines) - 1; i >= 0; i-- {
		line := untrusted.Escape(strings.TrimSpace(lines[i]))
		if line == "" {
			continue
		}
		if len(kept) == 0 && len(line) > limit {
			return strings.ToValidUTF8(line[:limit], "")
		}
		if size+len(line)+3 > limit && len(kept) > 0 {
			break
		}
		kept = append(kept, line)
		size += len(line) + 3
	}
	slices.Reverse(kept)
	return strings.Join(kept, " | ")
}

// securePath is the PATH of a clean environment: sudo's secure_path.
const securePath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// cleanEnv returns the clean environment of a command run as uid (-1:
// kvmount's own user).
func cleanEnv(uid int) []string {
	if uid < 0 {
		uid = os.Geteuid()
	}
	home, name, shell := "/", "", "/bin/sh"
	if u, err := user.LookupId(strconv.Itoa(uid)); err == nil {
		name = u.Username
		if u.HomeDir != "" {
			home = u.HomeDir
		}
	}
	env := []string{"PATH=" + securePath, "HOME=" + home, "SHELL=" + shell}
	if name != "" {
		env = append(env, "USER="+name, "LOGNAME="+name)
	}
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if name == "LANG" || name == "LANGUAGE" || name == "TZ" || strings.HasPrefix(name, "LC_") {
			env = append(env, kv)
		}
	}
	return env
}

// supplementaryGroups returns the supplementary groups of user uid from
// the group database, as login would give them; none when it has no
// entry.
func supplementaryGroups(uid int) []uint32 {
	u, err := user.LookupId(strconv.Itoa(uid))
	if err != nil {
		return []uint32{}
	}
	ids, err := u.GroupIds()
	if err != nil {
		return []uint32{}
	}
	groups := make([]uint32, 0, len(ids))
	for _, id := range ids {
		if n, err := strconv.ParseUint(id, 10, 32); err == nil {
			groups = append(groups, uint32(n))
		}
	}
	return groups
}

// limitedBuffer keeps the first OutputLimit bytes written to it. It holds
// its bytes.Buffer in a field: embedded, the buffer's ReadFrom would be
// promoted, and io.Copy (which os/exec uses) would bypass the limit.
type limitedBuffer struct{ buf bytes.Buffer }

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := OutputLimit - b.buf.Len(); room > 0 {
		b.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func (b *limitedBuffer) String() string { return b.buf.String() }
