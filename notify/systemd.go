package notify

import (
	"context"
	"fmt"
	"path"

	"github.com/coreos/go-systemd/v22/dbus"

	"github.com/kvmount/kvmount/config"
)

// SystemdConnector opens a connection to systemd's manager.
type SystemdConnector interface {
	Connect(ctx context.Context) (SystemdManager, error)
}

// SystemdManager is the part of systemd's D-Bus API the notifier uses
// (github.com/coreos/go-systemd/v22/dbus.Conn has it). Each method starts a
// job and sends its result ("done", "failed", "canceled", ...) on ch.
type SystemdManager interface {
	ReloadUnitContext(ctx context.Context, name, mode string, ch chan<- string) (int, error)
	RestartUnitContext(ctx context.Context, name, mode string, ch chan<- string) (int, error)
	ReloadOrTryRestartUnitContext(ctx context.Context, name, mode string, ch chan<- string) (int, error)
	// ControlGroup returns the unit's control group, such as
	// "/system.slice/nginx.service"; "" when it has none (not running).
	ControlGroup(ctx context.Context, unit string) (string, error)
	Close()
}

// systemBus connects to systemd on the system bus.
type systemBus struct{}

func (systemBus) Connect(ctx context.Context) (SystemdManager, error) {
	conn, err := dbus.NewSystemConnectionContext(ctx)
	if err != nil {
		return nil, err
	}
	return busManager{conn}, nil
}

// busManager is systemd's manager over D-Bus.
type busManager struct{ *dbus.Conn }

// unitTypes maps a unit name's suffix to the D-Bus interface that holds
// its ControlGroup property (org.freedesktop.systemd1.Service, ...).
var unitTypes = map[string]string{".service": "Service", ".scope": "Scope", ".socket": "Socket", ".mount": "Mount", ".swap": "Swap", ".slice": "Slice"}

// ControlGroup reads the unit's ControlGroup property.
func (m busManager) ControlGroup(ctx context.Context, unit string) (string, error) {
	typ, ok := unitTypes[path.Ext(unit)]
	if !ok {
		return "", fmt.Errorf("%s: a unit of this type has no control group", unit)
	}
	p, err := m.GetUnitTypePropertyContext(ctx, unit, typ, "ControlGroup")
	if err != nil {
		return "", err
	}
	cg, _ := p.Value.Value().(string)
	return cg, nil
}

// systemdJob asks systemd to reload or restart the entry's unit, with job
// mode "replace", and waits for the job's result: anything but "done" is an
// error. The actions are systemctl's: reload, restart, and
// try-reload-or-restart (systemd's ReloadOrTryRestartUnit: reload if the
// unit supports it, else restart, and only if it is running).
func (n *Notifier) systemdJob(ctx context.Context, e config.Notify) error {
	ctx, cancel := context.WithTimeout(ctx, e.Timeout)
	defer cancel()
	conn, err := n.opts.SystemdConn.Connect(ctx)
	if err != nil {
		return fmt.Errorf("systemd_unit %s: connecting to systemd over D-Bus: %w", e.Unit, err)
	}
	defer conn.Close()
	start := conn.ReloadUnitContext
	switch e.Action {
	case config.ActionRestart:
		start = conn.RestartUnitContext
	case config.ActionTryReloadOrRestart:
		start = conn.ReloadOrTryRestartUnitContext
	}
	ch := make(chan string, 1)
	if _, err := start(ctx, e.Unit, "replace", ch); err != nil {
		return fmt.Errorf("systemd_unit %s: %s: %w", e.Unit, e.Action, err)
	}
	select {
	case result := <-ch:
		if result != "done" {
			return fmt.Errorf("systemd_unit %s: %s job %s", e.Unit, e.Action, result)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("systemd_unit %s: %s job not finished after %v", e.Unit, e.Action, e.Timeout)
	}
}
