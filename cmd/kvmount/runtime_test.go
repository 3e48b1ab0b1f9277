package main

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestMonitorCollectorTarget runs the binary without GOGC and with it: the
// monitor's collector target, as its own /metrics shows it
// (go_gc_gogc_percent, runtime/metrics' /gc/gogc:percent), is 25 when the
// environment sets none (daemon.monitorGCPercent), and what GOGC says
// when it does.
func TestMonitorCollectorTarget(t *testing.T) {
	e := newEnv(t)
	e.put("/app/a", "1")
	e.writeConfig("app")
	percent := regexp.MustCompile(`(?m)^go_gc_gogc_percent (\S+)$`)
	for _, tc := range []struct {
		gogc, want string
	}{{"", "25"}, {"100", "100"}, {"50", "50"}} {
		environ := slices.DeleteFunc(os.Environ(), func(v string) bool { return strings.HasPrefix(v, "GOGC=") })
		if tc.gogc != "" {
			environ = append(environ, "GOGC="+tc.gogc)
		}
		cmd, logs := e.startIn(environ, "run")
		waitFile(t, filepath.Join(e.dir("app"), "a"), "1")
		// The socket's file can be there before the daemon listens on it
		// (bound, not yet listening: connection refused, seen in CI), or
		// left by the run before.
		var metrics string
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
			var err error
			if metrics, err = privateFetch(e.socket(), "/metrics"); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("GOGC=%q: the admin socket never answered: %v; logs:\n%s", tc.gogc, err, logs)
			}
		}
		m := percent.FindStringSubmatch(metrics)
		if m == nil || m[1] != tc.want {
			t.Errorf("GOGC=%q: go_gc_gogc_percent %v, want %s", tc.gogc, m, tc.want)
		}
		if err := cmd.Process.Signal(os.Interrupt); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatalf("GOGC=%q: kvmount exited with %v; logs:\n%s", tc.gogc, err, logs)
		}
	}
}
