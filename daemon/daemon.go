// Package daemon assembles kvmount from its parts — configuration, sources
// and their shared cache, populator and reconciler — and runs them: Run as
// the long-lived service that follows every change and reloads its
// configuration on request, Once to project every mount a single time.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"reflect"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/reconcile"
	"github.com/kvmount/kvmount/source"
)

// Options configure Run and Once.
type Options struct {
	// ConfigPath is the TOML configuration file.
	ConfigPath string
	// Registry holds the source kinds.
	Registry *source.Registry
	// LogOutput receives the logs; format and level come from the
	// configuration file.
	LogOutput io.Writer
	// Reload delivers a signal for every reload request (SIGHUP).
	Reload <-chan os.Signal
	// Abort, closed after the context is done (a second SIGTERM), cuts
	// the stop short: running check commands are killed; writes finish.
	Abort <-chan struct{}
	// Notify, when set, is told of the daemon's life: "ready" once every
	// mount has been projected or has settled on an error, "reloading" and
	// "ready" around a reload, "stopping" at the end (systemd's sd_notify
	// states).
	Notify func(state string)
}

// instance is one opened source and the configuration it was opened with.
type instance struct {
	cfg *config.Source
	src source.Source
}

// daemon is one run's state.
type daemon struct {
	opts    Options
	log     *slog.Logger
	level   *slog.LevelVar
	cfg     *config.Config
	sources map[string]instance
	cache   *source.Cache
	pop     *reconcile.Populator
	rec     *reconcile.Reconciler
	lock    *stateLock
	ready   bool
}

// load reads the configuration and wires the parts; nothing runs yet.
func load(opts Options, onSync func(*daemon, []reconcile.MountStatus)) (*daemon, error) {
	cfg, err := config.Load(opts.ConfigPath, opts.Registry.Decoders())
	if err != nil {
		return nil, err
	}
	d := &daemon{opts: opts, cfg: cfg, level: new(slog.LevelVar), sources: map[string]instance{}}
	d.level.Set(cfg.LogLevel)
	d.log = NewLogger(opts.LogOutput, cfg.LogFormat, d.level)
	logWarnings(d.log, cfg)
	if d.lock, err = lockStateDir(cfg.StateDir); err != nil {
		return nil, err
	}
	owned, err := reconcile.LoadOwned(cfg.StateDir)
	if err != nil {
		d.lock.release()
		return nil, err
	}
	trigger := reconcile.NewTrigger()
	d.cache = source.NewCache(d.log, trigger.Fire)
	opened, err := d.openSources(cfg)
	if err != nil {
		d.lock.release()
		return nil, err
	}
	d.setSources(opened)
	d.pop = reconcile.NewPopulator(d.cache, d.log)
	if err := d.pop.SetMounts(cfg.Mounts); err != nil {
		d.close()
		return nil, err
	}
	d.rec = reconcile.New(d.pop, owned, trigger, d.log, reconcile.Options{
		ResyncInterval: cfg.ResyncInterval,
		Abort:          opts.Abort,
		OnSync:         func(st []reconcile.MountStatus) { onSync(d, st) },
	})
	return d, nil
}

// logWarnings logs the configuration's warnings.
func logWarnings(log *slog.Logger, cfg *config.Config) {
	for _, w := range cfg.Warnings {
		log.Warn("configuration warning", "warning", w.Error())
	}
}

// NewLogger returns a logger writing text or JSON lines to w at level.
func NewLogger(w io.Writer, format string, level slog.Leveler) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// openSources opens every source of cfg, reusing the instances whose
// configuration did not change. On error it closes what it opened.
func (d *daemon) openSources(cfg *config.Config) (map[string]instance, error) {
	out := make(map[string]instance, len(cfg.Sources))
	var fresh []source.Source
	for name, sc := range cfg.Sources {
		if old, ok := d.sources[name]; ok && reflect.DeepEqual(old.cfg, sc) {
			out[name] = old
			continue
		}
		src, err := d.opts.Registry.Open(sc, d.log)
		if err != nil {
			for _, s := range fresh {
				s.Close()
			}
			return nil, err
		}
		fresh = append(fresh, src)
		out[name] = instance{cfg: sc, src: src}
	}
	return out, nil
}

func (d *daemon) setSources(sources map[string]instance) {
	d.cache.SetSources(sourceMap(sources))
	d.sources = sources
}

// sourceMap returns the opened sources by name.
func sourceMap(sources map[string]instance) map[string]source.Source {
	m := make(map[string]source.Source, len(sources))
	for name, in := range sources {
		m[name] = in.src
	}
	return m
}

// close stops the follows, closes the sources and releases the state
// directory's lock.
func (d *daemon) close() {
	if d.pop != nil {
		d.pop.Close()
	}
	d.cache.Close()
	d.lock.release()
}

// Run runs the daemon until ctx is done, re-reading the configuration on
// each Options.Reload. It holds an exclusive lock on the state directory
// for its whole life; another instance holding it makes Run return an
// error wrapping ErrLocked at once. An invalid configuration at start is returned; an
// invalid one at reload is logged and the running one stays in force. It
// returns nil after a clean stop: running operations finish, no write is
// left half done.
func Run(ctx context.Context, opts Options) error {
	d, err := load(opts, (*daemon).onSync)
	if err != nil {
		return err
	}
	d.log.Info("kvmount started", "config", opts.ConfigPath, "mounts", len(d.cfg.Mounts), "sources", len(d.cfg.Sources))
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		// STOPPING=1 as soon as the stop is asked for, not once the
		// operations in flight have finished.
		<-gctx.Done()
		d.notify("stopping")
		return nil
	})
	g.Go(func() error { return d.rec.Run(gctx) })
	g.Go(func() error {
		for {
			select {
			case <-gctx.Done():
				return nil
			case <-opts.Reload:
				d.reload(gctx)
			}
		}
	})
	err = g.Wait()
	d.close()
	d.log.Info("kvmount stopped")
	return err
}

// reload re-reads the configuration and applies it: changed sources are
// reopened, added mounts set up, removed ones torn down; unchanged mounts are
// not touched.
func (d *daemon) reload(ctx context.Context) {
	d.notify("reloading")
	defer d.notify("ready")
	cfg, err := config.Load(d.opts.ConfigPath, d.opts.Registry.Decoders())
	if err != nil {
		d.log.Error("invalid configuration; the running one stays in force", "config", d.opts.ConfigPath, "err", err)
		return
	}
	logWarnings(d.log, cfg)
	if cfg.StateDir != d.cfg.StateDir {
		d.log.Warn("state_dir changes take effect at restart", "running", d.cfg.StateDir, "configured", cfg.StateDir)
	}
	if cfg.LogFormat != d.cfg.LogFormat {
		d.log.Warn("log_format changes take effect at restart", "running", d.cfg.LogFormat, "configured", cfg.LogFormat)
	}
	opened, err := d.openSources(cfg)
	if err != nil {
		d.log.Error("cannot open sources; the running configuration stays in force", "err", err)
		return
	}
	// Sources and the mounts that use them change in one step of the
	// reconciler's loop.
	err = d.rec.Reload(ctx, reconcile.ReloadConfig{Mounts: cfg.Mounts, Sources: sourceMap(opened), ResyncInterval: cfg.ResyncInterval})
	d.sources = opened
	if err != nil {
		d.log.Error("cannot apply mounts", "err", err)
		return
	}
	d.level.Set(cfg.LogLevel)
	d.cfg.Sources, d.cfg.Mounts, d.cfg.LogLevel, d.cfg.ResyncInterval = cfg.Sources, cfg.Mounts, cfg.LogLevel, cfg.ResyncInterval
	d.log.Info("configuration reloaded", "mounts", len(cfg.Mounts), "sources", len(cfg.Sources))
}

// onSync reports readiness once every mount has settled.
func (d *daemon) onSync(st []reconcile.MountStatus) {
	if !d.ready && settled(st) {
		d.ready = true
		d.notify("ready")
	}
}

func (d *daemon) notify(state string) {
	if d.opts.Notify != nil {
		d.opts.Notify(state)
	}
}

// settled reports whether every mount is projected or has met an error
// (its payload failed, its operation failed, or its source is unreachable).
func settled(st []reconcile.MountStatus) bool {
	for _, m := range st {
		if !m.Projected && m.Err == nil && len(m.Stale) == 0 {
			return false
		}
	}
	return true
}

// OnceError lists the mounts that Once could not project.
type OnceError struct {
	// Failed maps each non-optional mount that was not projected to why.
	Failed map[string]string
}

// Error lists the mounts not projected and why, one per line.
func (e *OnceError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d mount(s) not projected:", len(e.Failed))
	for name, why := range e.Failed {
		fmt.Fprintf(&b, "\n  %s: %s", name, why)
	}
	return b.String()
}

// Once projects every mount once and returns when each has settled (see
// Run's readiness) or timeout has passed. It returns nil when every
// non-optional mount was projected, an *OnceError naming the others, or the
// configuration's error. Like Run, it holds the state directory's lock
// while it works (see ErrLocked).
func Once(ctx context.Context, opts Options, timeout time.Duration) error {
	var final []reconcile.MountStatus
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	d, err := load(opts, func(_ *daemon, st []reconcile.MountStatus) {
		final = st
		if settled(st) {
			cancel()
		}
	})
	if err != nil {
		return err
	}
	err = d.rec.Run(ctx)
	d.close()
	if err != nil {
		return err
	}
	failed := map[string]string{}
	for _, m := range final {
		if m.Projected || m.Optional {
			continue
		}
		switch {
		case m.Err != nil:
			failed[m.Name] = m.Err.Error()
		case len(m.Stale) > 0:
			failed[m.Name] = errors.Join(m.Stale...).Error()
		case len(m.Waiting) > 0:
			failed[m.Name] = fmt.Sprintf("no snapshot from %s within %v", strings.Join(m.Waiting, ", "), timeout)
		default:
			failed[m.Name] = fmt.Sprintf("not projected within %v", timeout)
		}
	}
	if len(failed) > 0 {
		return &OnceError{Failed: failed}
	}
	return nil
}
