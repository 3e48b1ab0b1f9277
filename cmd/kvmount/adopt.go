package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"time"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/daemon"
	"github.com/kvmount/kvmount/untrusted"
)

// adoptWait is how long adopt waits for the running daemon's attempt to
// set the mount up before it reports the mount's state.
const adoptWait = 10 * time.Second

// adopt asks the daemon that configPath configures to take the directory
// the path of mount reaches now for the mount's own (POST /adopt on its
// private socket), then waits up to adoptWait for the mount to become
// current and prints its state. With no daemon listening there, it
// changes the state directory's record itself (daemon.AdoptStopped), for
// the next start. It returns 0 when the mount is current (or, with no
// daemon, recorded), 1 when the daemon refused or the mount is still not
// current, 2 when neither way works.
func adopt(ctx context.Context, opts daemon.Options, mount string, stdout, stderr io.Writer) int {
	if mount == "" {
		fmt.Fprintln(stderr, "kvmount adopt: -mount NAME is required")
		return exitUsage
	}
	cfg, err := config.Load(opts.ConfigPath, opts.Registry.Decoders())
	if err != nil {
		fmt.Fprintln(stderr, err)
		return exitUnreachable
	}
	if cfg.AdminSocket != "" {
		code, err := adoptRunning(ctx, cfg.AdminSocket, mount, stdout, stderr)
		if !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
			if err != nil {
				fmt.Fprintf(stderr, "kvmount adopt: the daemon at %s: %v\n", cfg.AdminSocket, err)
			}
			return code
		}
	}
	if err := daemon.AdoptStopped(opts, mount); err != nil {
		fmt.Fprintf(stderr, "kvmount adopt: %v\n", err)
		return exitUnreachable
	}
	fmt.Fprintf(stdout, "mount %s: no daemon is running; the next start takes the directory %s reaches for its own\n", mount, dirOf(cfg, mount))
	return exitOK
}

// adoptRunning asks the daemon at socket to adopt mount and reports the
// outcome. An error wrapping ENOENT or ECONNREFUSED means no daemon
// listens there.
func adoptRunning(ctx context.Context, socket, mount string, stdout, stderr io.Writer) (int, error) {
	client, done := privateClient(socket)
	defer done()
	rctx, cancel := context.WithTimeout(ctx, statusTimeout+adoptWait)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, "http://kvmount/adopt?mount="+url.QueryEscape(mount), nil)
	if err != nil {
		return exitUnreachable, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return exitUnreachable, err
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		fmt.Fprintf(stderr, "kvmount adopt: %s\n", untrusted.Escape(strings.TrimSpace(string(body))))
		return exitFailure, nil
	}
	deadline := time.Now().Add(adoptWait)
	for {
		st, err := fetchStatus(ctx, socket)
		if err != nil {
			return exitUnreachable, err
		}
		m := st.Mounts[mount]
		if m != nil && (m.State == admin.StateCurrent || time.Now().After(deadline)) {
			line := fmt.Sprintf("mount %s: %s", mount, m.State)
			if m.LastError != "" {
				line += ": " + firstLine(m.LastError)
			}
			fmt.Fprintln(stdout, line)
			if m.State == admin.StateCurrent {
				return exitOK, nil
			}
			return exitFailure, nil
		}
		select {
		case <-ctx.Done():
			return exitFailure, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// dirOf returns the dir of the mount named name in cfg.
func dirOf(cfg *config.Config, name string) string {
	for _, m := range cfg.Mounts {
		if m.Name == name {
			return m.Dir
		}
	}
	return ""
}
