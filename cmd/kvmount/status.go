package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/source"
	"github.com/kvmount/kvmount/untrusted"
)

// Exit code of status when the daemon cannot be reached.
const exitUnreachable = 2

// statusTimeout bounds the request to the admin endpoint.
const statusTimeout = 5 * time.Second

// status asks the daemon that configPath configures for its /status, over
// its private admin socket, and prints one line per mount — name, state,
// version, age of the last success, last error or failing notification —
// then the sources that are down, the worker when it does not run or runs
// less confined than it should, and the admin endpoints that do not
// listen. It returns 0 when every non-optional mount is current and its
// notifications succeed, the worker runs, and every endpoint listens; 1
// otherwise; 2 when the daemon cannot be reached, or the socket is not
// root's.
func status(ctx context.Context, configPath string, reg *source.Registry, stdout, stderr io.Writer) int {
	cfg, err := config.Load(configPath, reg.Decoders())
	if err != nil {
		fmt.Fprintln(stderr, err)
		return exitUnreachable
	}
	if cfg.AdminSocket == "" {
		fmt.Fprintf(stderr, "kvmount status: %s turns the private admin socket off ([admin] socket = \"\")\n", configPath)
		return exitUnreachable
	}
	st, err := fetchStatus(ctx, cfg.AdminSocket)
	if err != nil {
		fmt.Fprintf(stderr, "kvmount status: the daemon at %s cannot be reached: %v\n", cfg.AdminSocket, err)
		return exitUnreachable
	}
	now := time.Now()
	names := make([]string, 0, len(st.Mounts))
	for name := range st.Mounts {
		names = append(names, name)
	}
	slices.Sort(names)
	ok := st.Ready
	for _, name := range names {
		m := st.Mounts[name]
		if m.State == admin.StateNotifyFailed {
			ok = false
		}
		age := "never"
		if m.LastSuccess != nil {
			age = now.Sub(*m.LastSuccess).Round(time.Second).String() + " ago"
		}
		version := m.Version
		if version == "" {
			version = "-"
		}
		line := fmt.Sprintf("%-20s %-8s %-32s %s", untrusted.Escape(name), untrusted.Escape(m.State), untrusted.Escape(version), age)
		if m.LastError != "" {
			line += "  " + firstLine(m.LastError)
		}
		fmt.Fprintln(stdout, strings.TrimRight(line, " "))
	}
	for name, src := range st.Sources {
		if !src.Up {
			fmt.Fprintf(stdout, "source %s is down: %s\n", untrusted.Escape(name), firstLine(src.LastError))
		}
	}
	for _, w := range st.Workers {
		if !w.Running {
			ok = false
			fmt.Fprintf(stdout, "worker of %s is not running: %s (started %d times; starting it again)\n", untrusted.Escape(w.Domain), firstLine(w.LastEnd), w.Starts)
		}
		for _, warning := range w.Warnings {
			fmt.Fprintf(stdout, "worker of %s: %s\n", untrusted.Escape(w.Domain), untrusted.Escape(warning))
		}
	}
	for _, ep := range st.Endpoints {
		if !ep.Listening {
			ok = false
			fmt.Fprintf(stdout, "admin endpoint %s does not listen: %s (retrying)\n", untrusted.Escape(ep.Address), firstLine(ep.Error))
		}
	}
	if !ok {
		return exitFailure
	}
	return exitOK
}

// fetchStatus GETs /status from the private admin socket at path (see
// privateClient).
func fetchStatus(ctx context.Context, path string) (*admin.Status, error) {
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	client, done := privateClient(path)
	defer done()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://kvmount/status", nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/status answered %s", resp.Status)
	}
	var st admin.Status
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&st); err != nil {
		return nil, fmt.Errorf("/status: %w", err)
	}
	return &st, nil
}

// privateClient returns a client of the private admin socket at path that
// checks, before each request, that the process listening there runs as
// root (or as the user running this command): SO_PEERCRED, not the path,
// says who answers. done releases its connections.
func privateClient(path string) (client *http.Client, done func()) {
	transport := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", path)
		if err != nil {
			return nil, err
		}
		if err := checkPeer(c.(*net.UnixConn)); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}}
	return &http.Client{Transport: transport}, transport.CloseIdleConnections
}

// checkPeer returns an error unless the process at the other end of c runs
// as root or as this process's user.
func checkPeer(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if cred.Uid != 0 && int(cred.Uid) != os.Geteuid() {
		return fmt.Errorf("the socket is served by uid %d (pid %d), not root: not kvmount", cred.Uid, cred.Pid)
	}
	return nil
}

// firstLine cuts s at its first newline and escapes it
// (untrusted.Escape): what /status says comes from keys, disks, servers
// and commands others control, and goes to a terminal.
func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return untrusted.Escape(s)
}
