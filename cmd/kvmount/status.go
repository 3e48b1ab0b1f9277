package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/source"
)

// Exit code of status when the daemon cannot be reached.
const exitUnreachable = 2

// statusTimeout bounds the request to the admin endpoint.
const statusTimeout = 5 * time.Second

// status asks the daemon that configPath configures for its /status and
// prints one line per mount — name, state, version, age of the last
// success, last error — and the sources that are down. It returns 0 when
// the daemon is ready (every non-optional mount current), 1 when it is
// not, 2 when it cannot be reached.
func status(ctx context.Context, configPath string, reg *source.Registry, stdout, stderr io.Writer) int {
	cfg, err := config.Load(configPath, reg.Decoders())
	if err != nil {
		fmt.Fprintln(stderr, err)
		return exitUnreachable
	}
	if cfg.Admin == "" {
		fmt.Fprintf(stderr, "kvmount status: %s turns the admin endpoint off ([admin] address = \"\")\n", configPath)
		return exitUnreachable
	}
	st, err := fetchStatus(ctx, cfg.Admin)
	if err != nil {
		fmt.Fprintf(stderr, "kvmount status: the daemon at %s cannot be reached: %v\n", cfg.Admin, err)
		return exitUnreachable
	}
	now := time.Now()
	names := make([]string, 0, len(st.Mounts))
	for name := range st.Mounts {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		m := st.Mounts[name]
		age := "never"
		if m.LastSuccess != nil {
			age = now.Sub(*m.LastSuccess).Round(time.Second).String() + " ago"
		}
		version := m.Version
		if version == "" {
			version = "-"
		}
		line := fmt.Sprintf("%-20s %-8s %-32s %s", name, m.State, version, age)
		if m.LastError != "" {
			line += "  " + firstLine(m.LastError)
		}
		fmt.Fprintln(stdout, strings.TrimRight(line, " "))
	}
	for name, src := range st.Sources {
		if !src.Up {
			fmt.Fprintf(stdout, "source %s is down: %s\n", name, firstLine(src.LastError))
		}
	}
	if !st.Ready {
		return exitFailure
	}
	return exitOK
}

// fetchStatus GETs /status from the admin endpoint at address ("host:port"
// or "unix:/path").
func fetchStatus(ctx context.Context, address string) (*admin.Status, error) {
	ctx, cancel := context.WithTimeout(ctx, statusTimeout)
	defer cancel()
	transport := &http.Transport{}
	url := "http://" + address + "/status"
	if path, ok := strings.CutPrefix(address, "unix:"); ok {
		transport.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}
		url = "http://kvmount/status"
	}
	defer transport.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := (&http.Client{Transport: transport}).Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/status answered %s", resp.Status)
	}
	var st admin.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return nil, fmt.Errorf("/status: %w", err)
	}
	return &st, nil
}

// firstLine cuts s at its first newline.
func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	return s
}
