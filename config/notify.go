package config

import (
	"net/url"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Kinds of [[mount.notify]] entries.
const (
	NotifyCommand = "command"
	NotifySignal  = "signal"
	NotifySystemd = "systemd_unit"
	NotifyWebhook = "webhook"
)

// Actions of a systemd_unit entry, as systemctl names them.
const (
	ActionReload             = "reload"
	ActionRestart            = "restart"
	ActionTryReloadOrRestart = "try-reload-or-restart"
)

// DefaultNotifyTimeout bounds one notification attempt.
const DefaultNotifyTimeout = 30 * time.Second

// Notify is one [[mount.notify]] entry: a way to tell a service that the
// mount changed, run after each switch that changed it.
type Notify struct {
	// Kind is NotifyCommand, NotifySignal, NotifySystemd or NotifyWebhook:
	// which of command, signal, systemd_unit and webhook is set.
	Kind string
	// Command is the argv of a command entry; no shell.
	Command []string
	// Signal and PIDFile: the signal sent to the process whose PID the
	// file holds, read at each notification. PIDUnit, when set, is the
	// systemd unit whose control group the process must belong to —
	// required for a PID file root does not own.
	Signal  syscall.Signal
	PIDFile string
	PIDUnit string
	// Unit and Action: the systemd unit and what to do with it.
	Unit, Action string
	// Webhook is the URL a JSON description of the change is POSTed to,
	// with Headers and HeaderFiles (values read from files, never logged).
	Webhook     string
	Headers     map[string]string
	HeaderFiles map[string]Secret
	// Timeout bounds one attempt.
	Timeout time.Duration
	// UID and GID run a command entry: the mount's notify_user (see
	// Mount.NotifyUID).
	UID, GID int
}

// Target names what the entry addresses, for logs and metrics: the
// program, the PID file, the unit, or the webhook URL without credentials
// or query.
func (n Notify) Target() string {
	switch n.Kind {
	case NotifyCommand:
		if len(n.Command) > 0 {
			return n.Command[0]
		}
	case NotifySignal:
		return n.PIDFile
	case NotifySystemd:
		return n.Unit
	case NotifyWebhook:
		if u, err := url.Parse(n.Webhook); err == nil {
			u.User, u.RawQuery, u.Fragment, u.RawFragment = nil, "", "", ""
			return u.String()
		}
	}
	return ""
}

// Wait is a mount's quiescence (consul-template's wait): after a change,
// project once Min has passed without another change, and at most Max
// after the first change. Zero Min means no wait.
type Wait struct {
	Min, Max time.Duration
}

// decodeNotify decodes one [[mount.notify]] entry.
func decodeNotify(sec *Section) Notify {
	defer sec.Done()
	n := Notify{Timeout: sec.Duration("timeout", DefaultNotifyTimeout)}
	var kinds []string
	for _, k := range []string{NotifyCommand, NotifySignal, NotifySystemd, NotifyWebhook} {
		if sec.Has(k) {
			kinds = append(kinds, k)
		}
	}
	switch len(kinds) {
	case 0:
		sec.Errorf("", "needs one of command, signal, systemd_unit or webhook")
	case 1:
		n.Kind = kinds[0]
	default:
		sec.Errorf(kinds[1], "an entry has one kind; %s and %s are both set (use two [[mount.notify]] entries)", kinds[0], kinds[1])
	}
	only := func(key, kind string) {
		if sec.Has(key) && n.Kind != kind {
			sec.Errorf(key, "applies to %s entries only", kind)
		}
	}
	only("pid_file", NotifySignal)
	only("unit", NotifySignal)
	only("action", NotifySystemd)
	only("headers", NotifyWebhook)
	only("header_files", NotifyWebhook)
	switch n.Kind {
	case NotifyCommand:
		n.Command = sec.Strings(NotifyCommand)
		if len(n.Command) == 0 || n.Command[0] == "" {
			sec.Errorf(NotifyCommand, "needs a program, such as [\"/usr/sbin/nginx\", \"-s\", \"reload\"]")
		}
	case NotifySignal:
		name := strings.ToUpper(sec.String(NotifySignal, ""))
		if !strings.HasPrefix(name, "SIG") {
			name = "SIG" + name
		}
		if n.Signal = unix.SignalNum(name); n.Signal == 0 {
			sec.Errorf(NotifySignal, "unknown signal %q; want a name such as \"SIGHUP\"", sec.String(NotifySignal, ""))
		}
		n.PIDFile = sec.String("pid_file", "")
		if n.PIDFile == "" {
			sec.Errorf("", "a signal entry needs pid_file")
		} else if !strings.HasPrefix(n.PIDFile, "/") {
			sec.Errorf("pid_file", "%q is not an absolute path", n.PIDFile)
		}
		n.PIDUnit = sec.String("unit", "")
		if sec.Has("unit") && (n.PIDUnit == "" || strings.ContainsAny(n.PIDUnit, "/ \t") || !strings.Contains(n.PIDUnit, ".")) {
			sec.Errorf("unit", "%q is not a unit name such as \"nginx.service\"", n.PIDUnit)
		}
	case NotifySystemd:
		n.Unit = sec.String(NotifySystemd, "")
		if n.Unit == "" || strings.ContainsAny(n.Unit, "/ \t") {
			sec.Errorf(NotifySystemd, "%q is not a unit name such as \"nginx.service\"", n.Unit)
		}
		n.Action = sec.Choice("action", ActionReload, ActionReload, ActionRestart, ActionTryReloadOrRestart)
	case NotifyWebhook:
		n.Webhook = sec.String(NotifyWebhook, "")
		if u, err := url.Parse(n.Webhook); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			sec.Errorf(NotifyWebhook, "%q: want an http:// or https:// URL", n.Webhook)
		}
		n.Headers = sec.StringMap("headers")
		n.HeaderFiles = sec.SecretFileMap("header_files")
		for name := range n.HeaderFiles {
			if _, dup := n.Headers[name]; dup {
				sec.Errorf("header_files", "header %q is also in headers", name)
			}
		}
		sec.WarnInlineCredentials("headers", n.Headers)
		sec.WarnURLCredentials(NotifyWebhook, n.Webhook, len(n.Headers)+len(n.HeaderFiles) > 0)
	}
	return n
}

// decodeWait decodes a mount's wait = { min, max }.
func decodeWait(sec *Section) Wait {
	if !sec.Has("wait") {
		return Wait{}
	}
	t := sec.Table("wait")
	defer t.Done()
	w := Wait{Min: t.Duration("min", 0)}
	if !t.Has("min") {
		t.Errorf("", "needs min, the quiet time after a change")
	}
	w.Max = t.Duration("max", 4*w.Min)
	if w.Max < w.Min {
		t.Errorf("max", "%v is shorter than min (%v)", w.Max, w.Min)
	}
	return w
}
