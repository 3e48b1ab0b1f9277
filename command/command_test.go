package command

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
)

func TestRun(t *testing.T) {
	dir := t.TempDir()
	out, err := Run(context.Background(), Spec{Argv: []string{"sh", "-c", `echo "$KVMOUNT_X in $(pwd)"; echo err >&2`}, Dir: dir, Env: []string{"KVMOUNT_X=hello"}})
	if err != nil || !strings.Contains(out, "hello in "+dir) || !strings.Contains(out, "err") {
		t.Errorf("Run = %q, %v; want the environment, the working directory and stderr", out, err)
	}
	// Without a Dir: "/", never kvmount's own working directory.
	if out, err := Run(context.Background(), Spec{Argv: []string{"pwd"}}); err != nil || out != "/" {
		t.Errorf("the default working directory = %q, %v; want /", out, err)
	}
	_, err = Run(context.Background(), Spec{Argv: []string{"sh", "-c", "exit 3"}})
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 3 {
		t.Errorf("exit 3: %v", err)
	}
	start := time.Now()
	_, err = Run(context.Background(), Spec{Argv: []string{"sleep", "30"}, Timeout: 100 * time.Millisecond})
	if !errors.Is(err, ErrTimeout) || time.Since(start) > 10*time.Second {
		t.Errorf("timeout: %v after %v", err, time.Since(start))
	}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	if _, err := Run(ctx, Spec{Argv: []string{"sleep", "30"}}); !errors.Is(err, ErrKilled) {
		t.Errorf("cancelled: %v; want ErrKilled", err)
	}
	if _, err := Run(context.Background(), Spec{Argv: []string{"/nonexistent/program"}}); err == nil {
		t.Errorf("a missing program ran")
	}
	out, _ = Run(context.Background(), Spec{Argv: []string{"sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x"}})
	if len(out) != OutputLimit {
		t.Errorf("kept %d bytes of output; want %d", len(out), OutputLimit)
	}
}

func TestRunAsUser(t *testing.T) {
	roottest.Require(t)
	out, err := Run(context.Background(), Spec{Argv: []string{"id", "-u"}, UID: 4321, GID: 4321, Dir: os.TempDir()})
	if err != nil || out != "4321" {
		t.Errorf("id -u as 4321 = %q, %v", out, err)
	}
}
