// Command kvmount keeps directories in sync with key-value data held in
// etcd, in Consul or behind an HTTP URL: run is the daemon, once projects
// every mount a single time, check validates a configuration file, status
// asks the running daemon, adopt takes over a mount directory kvmount
// cannot recognise, version prints the version.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	sddaemon "github.com/coreos/go-systemd/v22/daemon"
	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/daemon"
	"github.com/kvmount/kvmount/privsep"
	"github.com/kvmount/kvmount/source"
	"github.com/kvmount/kvmount/source/consul"
	"github.com/kvmount/kvmount/source/etcd"
	httpsource "github.com/kvmount/kvmount/source/http"
	"github.com/kvmount/kvmount/source/vault"
	"github.com/kvmount/kvmount/untrusted"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = ""

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

func main() {
	// The daemon's worker is this program started again (privsep).
	daemon.MaybeWorker(registry())
	if err := privsep.MarkInheritedCloseOnExec(); err != nil {
		fmt.Fprintln(os.Stderr, "kvmount:", err)
		os.Exit(exitFailure)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// registry is the table of source kinds kvmount is built with.
func registry() *source.Registry {
	return source.NewRegistry(etcd.Kind(), consul.Kind(), httpsource.Kind(), vault.Kind())
}

const usage = `usage: kvmount <command> [-config FILE]

commands:
  run      run the daemon: keep every mount in sync until SIGTERM; SIGHUP reloads the configuration
  once     project every mount once, then exit (0 when every non-optional mount was projected)
  check    validate the configuration file and exit; errors name file:line
  render   dry run: read the sources of -mount NAME once and print the files its payload would hold
           (mode, size, path), or with -path P the content of one file; the mount is not touched
  status   ask the running daemon (its admin endpoint): one line per mount;
           exit 0 when all are current, 1 when any is not, 2 when the daemon cannot be reached
  adopt    take the directory that the path of -mount NAME reaches now for the mount's own, when
           kvmount refuses it because it cannot tell (a remount renumbered a file system that keeps
           no marker): asks the running daemon, or with none running records it for the next start
  version  print the version
`

// run executes one command and returns the process's exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	cmd, args := args[0], args[1:]
	fs := flag.NewFlagSet("kvmount "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	configPath := fs.String("config", config.DefaultPath, "configuration `file`")
	timeout := time.Duration(0)
	var mountName, filePath string
	switch cmd {
	case "once":
		fs.DurationVar(&timeout, "timeout", 30*time.Second, "give up on mounts not projected after this `duration`")
	case "adopt":
		fs.StringVar(&mountName, "mount", "", "the `name` of the mount whose directory to take over")
	case "render":
		fs.DurationVar(&timeout, "timeout", 30*time.Second, "give up when the sources have not answered after this `duration`")
		fs.StringVar(&mountName, "mount", "", "the `name` of the mount to render")
		fs.StringVar(&filePath, "path", "", "print the content of this `path` of the mount instead of the list")
	}
	switch cmd {
	case "run", "once", "check", "status", "render", "adopt", "version":
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "kvmount: unknown command %q\n%s", cmd, usage)
		return exitUsage
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvmount %s: unexpected arguments %q\n", cmd, fs.Args())
		return exitUsage
	}
	opts := daemon.Options{ConfigPath: *configPath, Registry: registry(), LogOutput: stderr, Version: buildVersion()}
	var err error
	switch cmd {
	case "version":
		fmt.Fprintf(stdout, "kvmount %s (commit %s, %s)\n", buildVersion(), buildCommit(), runtime.Version())
		return exitOK
	case "check":
		var cfg *config.Config
		cfg, err = loadOrStop(ctx, *configPath, opts)
		if err == nil {
			err = daemon.CheckStateDir(cfg)
		}
		if err == nil {
			warnings := len(cfg.Warnings)
			for _, w := range cfg.Warnings {
				fmt.Fprintf(stderr, "warning: %s\n", untrusted.Escape(w.Error()))
			}
			for _, w := range daemon.Audit(cfg) {
				fmt.Fprintf(stderr, "warning: %s\n", untrusted.Escape(w))
				warnings++
			}
			worker, workerWarnings, werr := daemon.WorkerView(cfg, opts.WorkerGroup)
			if werr != nil {
				err = werr
				break
			}
			for _, w := range workerWarnings {
				fmt.Fprintf(stderr, "warning: %s\n", w)
				warnings++
			}
			fmt.Fprintf(stdout, "%s: OK (%s, %s, %s)\n", *configPath, count(len(cfg.Sources), "source"), count(len(cfg.Mounts), "mount"), count(warnings, "warning"))
			fmt.Fprintln(stdout, worker)
			if view := daemon.CheckView(cfg); view != "" {
				fmt.Fprintln(stdout, view)
			}
		}
	case "status":
		return status(ctx, *configPath, opts.Registry, stdout, stderr)
	case "adopt":
		return adopt(ctx, opts, mountName, stdout, stderr)
	case "render":
		return render(ctx, opts, mountName, filePath, timeout, stdout, stderr)
	case "once":
		err = daemon.Once(ctx, opts, timeout)
	case "run":
		hup := make(chan os.Signal, 1)
		signal.Notify(hup, syscall.SIGHUP)
		defer signal.Stop(hup)
		opts.Reload = hup
		opts.Notify = notifySystemd
		if interval, err := sddaemon.SdWatchdogEnabled(false); err == nil && interval > 0 {
			opts.WatchdogInterval = interval / 2
		}
		abort := make(chan struct{})
		opts.Abort = abort
		stopWatch := watchSecondSignal(ctx, abort, stderr)
		err = daemon.Run(ctx, opts)
		stopWatch()
	}
	if err != nil {
		fmt.Fprintln(stderr, untrusted.Escape(err.Error()))
		return exitFailure
	}
	return exitOK
}

// loadOrStop loads the configuration file, or returns ctx's error at once
// when a signal ends ctx first: no file it names can keep kvmount check
// from stopping on SIGTERM.
func loadOrStop(ctx context.Context, path string, opts daemon.Options) (*config.Config, error) {
	type loaded struct {
		cfg *config.Config
		err error
	}
	done := make(chan loaded, 1)
	go func() {
		cfg, err := config.Load(path, opts.Registry.Decoders())
		done <- loaded{cfg, err}
	}()
	select {
	case l := <-done:
		return l.cfg, l.err
	case <-ctx.Done():
		return nil, fmt.Errorf("kvmount check: stopped: %w", context.Cause(ctx))
	}
}

// watchSecondSignal closes abort when a second SIGTERM or SIGINT arrives
// after ctx is done (the first one): the daemon then stops without waiting
// for a check command in progress. The returned function stops watching.
func watchSecondSignal(ctx context.Context, abort chan<- struct{}, stderr io.Writer) (stop func()) {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		select {
		case <-ctx.Done():
		case <-done:
			return
		}
		for seen := 0; ; {
			select {
			case <-sigs:
				// The first signal is the one that ended ctx.
				if seen++; seen == 2 {
					fmt.Fprintln(stderr, "kvmount: second signal: stopping now")
					close(abort)
					return
				}
			case <-done:
				return
			}
		}
	}()
	return func() {
		signal.Stop(sigs)
		close(done)
		<-finished
	}
}

// notifySystemd tells systemd of the daemon's state when it runs as a
// Type=notify service; without NOTIFY_SOCKET it does nothing.
func notifySystemd(state string) {
	var msg string
	switch state {
	case "ready":
		msg = sddaemon.SdNotifyReady
	case "reloading":
		// Type=notify-reload (systemd ≥ 253) wants the monotonic time too.
		var ts unix.Timespec
		_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
		msg = sddaemon.SdNotifyReloading + "\nMONOTONIC_USEC=" + strconv.FormatInt(ts.Nano()/1000, 10)
	case "stopping":
		msg = sddaemon.SdNotifyStopping
	case "watchdog":
		msg = sddaemon.SdNotifyWatchdog
	default:
		text, ok := strings.CutPrefix(state, "status=")
		if !ok {
			return
		}
		msg = "STATUS=" + text
	}
	_, _ = sddaemon.SdNotify(false, msg)
}

// buildCommit returns the VCS revision Go recorded at build time, or
// "unknown".
func buildCommit() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			if s.Key == "vcs.revision" {
				if len(s.Value) > 12 {
					return s.Value[:12]
				}
				return s.Value
			}
		}
	}
	return "unknown"
}

// buildVersion returns the version set at build time, else the module
// version Go recorded, else "devel".
func buildVersion() string {
	if version != "" {
		return version
	}
	if info, ok := debug.ReadBuildInfo(); ok && info.Main.Version != "" && info.Main.Version != "(devel)" {
		return info.Main.Version
	}
	return "devel"
}

// count returns "1 noun" or "n nouns".
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
