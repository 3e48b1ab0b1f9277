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
	"strings"
	"syscall"
	"time"
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
	// Dir is the working directory; "" keeps kvmount's.
	Dir string
	// Env holds NAME=value pairs added to kvmount's environment.
	Env []string
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
	if len(s.Env) > 0 {
		cmd.Env = append(os.Environ(), s.Env...)
	}
	if s.UID >= 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(s.UID), Gid: uint32(s.GID)}}
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
