package notify

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

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

// Webhook is one delivery of a webhook entry, everything its POST needs:
// what the monitor hands the worker to send (Options.Webhooks).
type Webhook struct {
	// Mount is the mount whose change it reports: the worker of the
	// mount's trust domain delivers it.
	Mount string
	// URL is where it goes; Target names it in errors (the entry's
	// Target).
	URL, Target string
	// Header holds the entry's headers and header_files, name and value
	// in turn: any may be a credential, and none reaches another origin.
	Header []string
	// Body is the JSON of the change (webhookBody).
	Body []byte
	// Timeout bounds the delivery, from the connection to the response.
	Timeout time.Duration
}

// WebhookPoster delivers webhooks. PostWebhook returns Deliver's error,
// or why the delivery could not be made.
type WebhookPoster interface {
	PostWebhook(ctx context.Context, w Webhook) error
}

// postWebhook POSTs the change as JSON with the entry's headers, through
// Options.Webhooks, else itself (Deliver).
func (n *Notifier) postWebhook(ctx context.Context, e config.Notify, c Change) error {
	body, err := json.Marshal(webhookBody{Mount: c.Mount, Dir: c.Dir, Version: c.Version, Revision: c.Revision,
		Added: nonNil(c.Added), Changed: nonNil(c.Changed), Removed: nonNil(c.Removed)})
	if err != nil {
		return fmt.Errorf("webhook: %w", err)
	}
	w := Webhook{Mount: c.Mount, URL: e.Webhook, Target: e.Target(), Body: body, Timeout: e.Timeout}
	for _, name := range slices.Sorted(maps.Keys(e.Headers)) {
		w.Header = append(w.Header, name, e.Headers[name])
	}
	for _, name := range slices.Sorted(maps.Keys(e.HeaderFiles)) {
		w.Header = append(w.Header, name, e.HeaderFiles[name].Reveal())
	}
	if n.opts.Webhooks != nil {
		return n.opts.Webhooks.PostWebhook(ctx, w)
	}
	return Deliver(ctx, n.opts.HTTPClient, w)
}

// Deliver POSTs w with client (whose CheckRedirect it replaces); any
// status but 2xx is an error quoting the start of the response's body.
// Redirects follow origin.CheckRedirect: within the webhook's origin only,
// so that its headers never reach another, and https never falls back to
// http.
func Deliver(ctx context.Context, client *http.Client, w Webhook) error {
	ctx, cancel := context.WithTimeout(ctx, w.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL, bytes.NewReader(w.Body))
	if err != nil {
		return fmt.Errorf("webhook: %w", err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(w.Header); i += 2 {
		req.Header.Set(w.Header[i], w.Header[i+1])
	}
	c := *client
	c.CheckRedirect = origin.CheckRedirect()
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("webhook %s: %w", w.Target, errors.Unwrap(err))
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, webhookBodyLimit))
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("webhook %s: %s: %q", w.Target, resp.Status, strings.TrimSpace(string(msg)))
	}
	return nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
