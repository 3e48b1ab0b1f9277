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
	"strings"

	"github.com/kvmount/kvmount/command"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/origin"
)

// runCommand runs a command entry as the mount's notify_user (by default
// its user, else nobody), in "/" and a clean environment with the change
// in it: KVMOUNT_MOUNT, KVMOUNT_DIR, KVMOUNT_VERSION (the ..data target)
// and KVMOUNT_REVISION. Its output is logged at debug level only.
func runCommand(ctx context.Context, e config.Notify, c Change, log *slog.Logger) error {
	out, err := command.Run(ctx, command.Spec{
		Argv:     e.Command,
		Env:      []string{"KVMOUNT_MOUNT=" + c.Mount, "KVMOUNT_DIR=" + c.Dir, "KVMOUNT_VERSION=" + c.Version, "KVMOUNT_REVISION=" + c.Revision},
		ResetEnv: true,
		Timeout:  e.Timeout,
		UID:      e.UID,
		GID:      e.GID,
	})
	log.Debug("notify command finished", "command", e.Command[0], "err", err, "output", out)
	if err != nil {
		return fmt.Errorf("command %s: %w", e.Command[0], err)
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
// status but 2xx is an error. Redirects follow origin.CheckRedirect: the
// headers and header_files never reach another origin, and https never
// falls back to http.
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
	// Configured headers may hold credentials: they go to the webhook's
	// own origin only, as the HTTP source's do.
	var names []string
	for name := range e.Headers {
		names = append(names, name)
	}
	for name := range e.HeaderFiles {
		names = append(names, name)
	}
	client := *n.opts.HTTPClient
	client.CheckRedirect = origin.CheckRedirect(names...)
	resp, err := client.Do(req)
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
