package notify

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/command"
	"github.com/kvmount/kvmount/config"
)

// runCommand runs a command entry with the change in its environment:
// KVMOUNT_MOUNT, KVMOUNT_DIR, KVMOUNT_VERSION (the ..data target) and
// KVMOUNT_REVISION. Its output is logged at debug level only.
func runCommand(ctx context.Context, e config.Notify, c Change, log *slog.Logger) error {
	out, err := command.Run(ctx, command.Spec{
		Argv:    e.Command,
		Dir:     c.Dir,
		Env:     []string{"KVMOUNT_MOUNT=" + c.Mount, "KVMOUNT_DIR=" + c.Dir, "KVMOUNT_VERSION=" + c.Version, "KVMOUNT_REVISION=" + c.Revision},
		Timeout: e.Timeout,
		UID:     -1,
	})
	log.Debug("notify command finished", "command", e.Command[0], "err", err, "output", out)
	if err != nil {
		return fmt.Errorf("command %s: %w", e.Command[0], err)
	}
	return nil
}

// sendSignal reads the PID file (at each notification: the service may
// have restarted) and signals that process. A missing or malformed file, a
// PID of 1 or below, or a process that is gone is an error naming them.
func sendSignal(e config.Notify) error {
	data, err := os.ReadFile(e.PIDFile)
	if err != nil {
		return fmt.Errorf("signal %s: pid_file: %w", unix.SignalName(e.Signal), err)
	}
	text := strings.TrimSpace(string(data))
	pid, err := strconv.Atoi(text)
	switch {
	case err != nil:
		return fmt.Errorf("signal %s: pid_file %s holds %q, not a process ID", unix.SignalName(e.Signal), e.PIDFile, text)
	case pid <= 1:
		return fmt.Errorf("signal %s: pid_file %s names PID %d; refusing to signal it", unix.SignalName(e.Signal), e.PIDFile, pid)
	}
	if err := unix.Kill(pid, e.Signal); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("signal %s: process %d (from %s) is not running", unix.SignalName(e.Signal), pid, e.PIDFile)
		}
		return fmt.Errorf("signal %s: process %d (from %s): %w", unix.SignalName(e.Signal), pid, e.PIDFile, err)
	}
	return nil
}

// webhookBody is what a webhook receives: which paths changed, never their
// values.
type webhookBody struct {
	Mount    string   `json:"mount"`
	Dir      string   `json:"dir"`
	Version  string   `json:"version"`
	Revision string   `json:"revision"`
	Added    []string `json:"added"`
	Changed  []string `json:"changed"`
	Removed  []string `json:"removed"`
}

// webhookBodyLimit is how much of an error response's body is quoted.
const webhookBodyLimit = 512

// postWebhook POSTs the change as JSON with the entry's headers; any
// status but 2xx is an error.
func (n *Notifier) postWebhook(ctx context.Context, e config.Notify, c Change) error {
	body, err := json.Marshal(webhookBody{Mount: c.Mount, Dir: c.Dir, Version: c.Version, Revision: c.Revision,
		Added: nonNil(c.Added), Changed: nonNil(c.Changed), Removed: nonNil(c.Removed)})
	if err != nil {
		return fmt.Errorf("webhook: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, e.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.Webhook, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("webhook: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	for name, v := range e.Headers {
		req.Header.Set(name, v)
	}
	for name, v := range e.HeaderFiles {
		req.Header.Set(name, v.Reveal())
	}
	resp, err := n.opts.HTTPClient.Do(req)
	if err != nil {
		return fmt.Errorf("webhook %s: %w", e.Target(), errors.Unwrap(err))
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, webhookBodyLimit))
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("webhook %s: %s: %q", e.Target(), resp.Status, strings.TrimSpace(string(msg)))
	}
	return nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
