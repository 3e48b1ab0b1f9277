// Package daemon assembles kvmount from its parts — configuration, sources
// and their shared cache, populator and reconciler, the notifier and the
// admin endpoint — and runs them: Run as the long-lived service that
// follows every change and reloads its configuration on request, Once to
// project every mount a single time.
package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"reflect"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/reconcile"
	"github.com/kvmount/kvmount/source"
	"github.com/kvmount/kvmount/untrusted"
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
	// Version is reported by the admin endpoint (kvmount_build_info).
	Version string
	// Reload delivers a signal for every reload request (SIGHUP).
	Reload <-chan os.Signal
	// Abort, closed after the context is done (a second SIGTERM), cuts
	// the stop short: running check commands are killed; writes finish.
	Abort <-chan struct{}
	// Notify, when set, is told of the daemon's life with systemd's
	// sd_notify states: "ready" once every mount has been projected or has
	// settled on an error, "reloading" and "ready" around a reload,
	// "stopping" as soon as the context is done, "status=TEXT" when the
	// one-line summary of the mounts changes, and "watchdog" at
	// WatchdogInterval while the reconciler's loop answers.
	Notify func(state string)
	// WatchdogInterval, when positive, is how often "watchdog" is sent:
	// half of systemd's WATCHDOG_USEC.
	WatchdogInterval time.Duration
	// InProcess runs the sources, the populator and the templates in this
	// process, as it runs, instead of in an unprivileged worker (privsep):
	// for side-by-side benchmarks of the split only.
	InProcess bool
	// WorkerGroup is the group the workers run in; empty means
	// WorkerGroup. Each worker runs as a user of its own.
	WorkerGroup string
	// workerMode is the value of WorkerEnv the worker starts with:
	// "worker" when empty; a test's fake worker else (TestMain).
	workerMode string
	// heapQuiet replaces burstQuiet, the quiet that ends a burst of
	// writes before the heap is given back (heapRelease), when not zero:
	// for tests.
	heapQuiet time.Duration
}

// instance is one opened source and the configuration it was opened with.
type instance struct {
	cfg *config.Source
	src source.Source
}

// daemon is one run's state.
type daemon struct {
	opts     Options
	log      *slog.Logger
	level    *slog.LevelVar
	cfg      *config.Config
	sources  map[string]instance
	cache    *source.Cache
	pop      *reconcile.Populator
	rec      *reconcile.Reconciler
	lock     *stateLock
	owned    *reconcile.Owned
	notifier *notify.Notifier // nil in Once
	admin    *admin.Server    // nil in Once
	heap     *heapRelease     // nil in Once
	service  *service
	monitor  *monitor // nil with Options.InProcess
	// workers is the monitor's run of its workers, started by load;
	// nil with Options.InProcess.
	workers *workersRun
}

// load reads the configuration and wires the parts. The sources (or the
// monitor's workers, which read them) start at once, so that their first
// reads overlap the rest of the start; the reconciler does not run yet.
// With svc set (Run), it adds the notifier, the release of the heap after
// bursts of writes (heapRelease) and the admin endpoint,
// which listens in the background once Run starts it: a port someone else
// holds is reported and retried, and never keeps a mount from projecting.
func load(opts Options, observer reconcile.Observer, svc *service) (*daemon, error) {
	rec := &config.Recorder{}
	cfg, err := config.LoadWith(opts.ConfigPath, opts.Registry.Decoders(), rec)
	if err != nil {
		return nil, err
	}
	d := &daemon{opts: opts, cfg: cfg, level: new(slog.LevelVar), sources: map[string]instance{}}
	d.level.Set(cfg.LogLevel)
	d.log = NewLogger(opts.LogOutput, cfg.LogFormat, d.level)
	if d.lock, err = lockStateDir(cfg.StateDir); err != nil {
		return nil, err
	}
	owned, err := reconcile.LoadOwned(cfg.StateDir)
	if err != nil {
		d.lock.release()
		return nil, err
	}
	d.owned = owned
	observers := reconcile.Observers{observer}
	if svc != nil {
		d.admin = admin.New(admin.Options{Version: opts.Version, Log: d.log,
			Ping:  func(ctx context.Context) error { return d.rec.Ping(ctx) },
			Adopt: func(ctx context.Context, mount string) error { return d.rec.Adopt(ctx, mount) },
			Workers: func() []*admin.WorkerStatus {
				if d.monitor == nil {
					return nil
				}
				return d.monitor.workersStatus()
			}})
		observers = append(observers, d.admin)
		nopts := notify.Options{Log: d.log, OnResult: func(r notify.Result) {
			d.admin.NotifyResult(r)
			svc.notifyResult(r)
		}}
		if !opts.InProcess {
			// The worker delivers webhooks (d.monitor is set below,
			// before any notification).
			nopts.Webhooks = webhookPoster(func(ctx context.Context, w notify.Webhook) error { return d.monitor.PostWebhook(ctx, w) })
		}
		d.notifier = notify.New(nopts)
		d.notifier.SetMounts(cfg.Mounts)
		observers = append(observers, notifyChanges{d.notifier})
		d.heap = newHeapRelease(d.log, opts.heapQuiet)
		svc.release = d.heap.now
		observers = append(observers, d.heap)
	}
	trigger := reconcile.NewTrigger()
	var desired reconcile.Desired
	if opts.InProcess {
		d.cache = source.NewCache(d.log, trigger.Fire)
		opened, err := openSources(opts.Registry, nil, cfg, d.log, nil)
		if err != nil {
			d.close()
			return nil, err
		}
		d.setSources(opened)
		d.pop = reconcile.NewPopulator(d.cache, d.log)
		if err := d.pop.SetMounts(cfg.Mounts); err != nil {
			d.close()
			return nil, err
		}
		desired = d.pop
	} else {
		var onPayload func()
		if d.heap != nil {
			onPayload = d.heap.Payload
		}
		if d.monitor, err = newMonitor(d.log, cfg, rec, opts, onPayload); err != nil {
			d.close()
			return nil, err
		}
		desired = d.monitor.Remote()
		d.workers = startWorkers(d.monitor)
	}
	// The sources' first reads are under way (or the worker's): the
	// host's audit (a walk up every mount's path) runs while they are.
	logWarnings(d.log, cfg)
	d.rec = reconcile.New(desired, owned, trigger, d.log, reconcile.Options{
		ResyncInterval: cfg.ResyncInterval,
		Abort:          opts.Abort,
		Observer:       observers,
	})
	return d, nil
}

// logWarnings logs the configuration's warnings and the host's (Audit),
// and how check commands see the version they check.
func logWarnings(log *slog.Logger, cfg *config.Config) {
	for _, w := range cfg.Warnings {
		log.Warn("configuration warning", "warning", w.Error())
	}
	for _, w := range Audit(cfg) {
		log.Warn("host warning", "warning", w)
	}
	if view := CheckView(cfg); view != "" {
		log.Info(view)
	}
}

// NewLogger returns a logger writing text or JSON lines to w at level.
// Every string it logs — messages, string attributes, errors, lists of
// names — is escaped first (untrusted.Escape): log lines carry key names,
// paths found on disk, servers' status lines and commands' output, which
// others choose, and a JSON line would otherwise pass C1 controls and
// bidirectional overrides to the terminal that shows it.
func NewLogger(w io.Writer, format string, level slog.Leveler) *slog.Logger {
	opts := &slog.HandlerOptions{Level: level, ReplaceAttr: escapeAttr}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// escapeAttr escapes the outside text an attribute may carry.
func escapeAttr(_ []string, a slog.Attr) slog.Attr {
	switch v := a.Value; v.Kind() {
	case slog.KindString:
		if s := v.String(); untrusted.Escape(s) != s {
			a.Value = slog.StringValue(untrusted.Escape(s))
		}
	case slog.KindAny:
		switch x := v.Any().(type) {
		case error:
			a.Value = slog.StringValue(untrusted.Escape(x.Error()))
		case []string:
			escaped := make([]string, len(x))
			for i, s := range x {
				escaped[i] = untrusted.Escape(s)
			}
			a.Value = slog.AnyValue(escaped)
		case fmt.Stringer:
			a.Value = slog.StringValue(untrusted.Escape(x.String()))
		}
	}
	return a
}

// openSources opens every source of cfg, reusing the instances of running
// whose configuration did not change; files, when not nil, is where the
// sources read credential files again (source.Env.Files). On error it
// closes what it opened.
func openSources(registry *source.Registry, running map[string]instance, cfg *config.Config, log *slog.Logger, files config.Files) (map[string]instance, error) {
	out := make(map[string]instance, len(cfg.Sources))
	var fresh []source.Source
	for name, sc := range cfg.Sources {
		if old, ok := running[name]; ok && reflect.DeepEqual(old.cfg, sc) {
			out[name] = old
			continue
		}
		src, err := registry.Open(sc, source.Env{Log: log, Files: files})
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

// close stops the follows, closes the sources, stops the notifier and
// releases the state directory's lock. The cache closes first: its follows
// end as the daemon's stop, not as released ones (source.ErrReleased),
// whose leases a source revokes — a restart keeps them.
func (d *daemon) close() {
	if d.cache != nil {
		d.cache.Close()
	}
	if d.pop != nil {
		d.pop.Close()
	}
	if d.notifier != nil {
		d.notifier.Close()
	}
	if d.heap != nil {
		d.heap.stop()
	}
	if d.owned != nil {
		d.owned.Close()
	}
	if d.workers != nil {
		d.workers.stop()
	}
	if d.monitor != nil {
		d.monitor.Close()
	}
	d.lock.release()
}

// reloadSplit applies cfg with a worker: the monitor's mounts first (a
// new mount waits for the worker's payload, a removed one is torn down),
// then the worker's configuration; when the worker refuses it, the
// monitor's mounts go back to the running configuration's. It reports
// whether cfg is in force.
func (d *daemon) reloadSplit(ctx context.Context, cfg *config.Config, rec *config.Recorder) bool {
	if err := d.rec.Reload(ctx, reconcile.ReloadConfig{Mounts: cfg.Mounts, ResyncInterval: cfg.ResyncInterval}); err != nil {
		d.log.Error("cannot apply mounts", "err", err)
		return false
	}
	if err := d.monitor.Configure(ctx, cfg, inputs(cfg, rec)); err != nil {
		d.log.Error("the worker cannot apply the configuration; the running one stays in force", "err", err)
		if err := d.rec.Reload(ctx, reconcile.ReloadConfig{Mounts: d.cfg.Mounts}); err != nil {
			d.log.Error("cannot apply mounts", "err", err)
		}
		return false
	}
	return true
}

// Run runs the daemon until ctx is done, re-reading the configuration on
// each Options.Reload. It holds an exclusive lock on the state directory
// for its whole life; another instance holding it makes Run return an
// error wrapping ErrLocked at once. An invalid configuration at start is
// returned; an invalid configuration at reload is logged and the running
// one stays in force. The admin endpoints listen in the background (an address that
// cannot be listened on is retried and reported, never fatal). It returns
// nil after a clean stop: running operations finish, no write is left half
// done.
func Run(ctx context.Context, opts Options) error {
	svc := &service{notify: opts.Notify}
	d, err := load(opts, svc, svc)
	if err != nil {
		return err
	}
	// After the configuration's load, whose garbage at a small heap
	// would be collected a dozen times (monitorGCPercent).
	defer setMonitorGCPercent(os.Getenv)()
	d.service = svc
	d.log.Info("kvmount started", "config", opts.ConfigPath, "mounts", len(d.cfg.Mounts), "sources", len(d.cfg.Sources), "admin", d.cfg.Admin, "admin_socket", d.cfg.AdminSocket)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		// STOPPING=1 as soon as the stop is asked for, not once the
		// operations in flight have finished.
		<-gctx.Done()
		svc.send("stopping")
		return nil
	})
	g.Go(func() error { return d.rec.Run(gctx) })
	if d.workers != nil {
		g.Go(func() error { return d.workers.wait(gctx) })
	}
	d.admin.SetEndpoints(admin.Endpoints{Address: d.cfg.Admin, Socket: d.cfg.AdminSocket})
	g.Go(func() error { return d.admin.Run(gctx) })
	if opts.WatchdogInterval > 0 {
		g.Go(func() error {
			svc.watchdog(gctx, opts.WatchdogInterval, d.rec.Ping)
			return nil
		})
	}
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
// reopened, added mounts set up, removed ones torn down, notify entries
// and admin endpoints replaced; unchanged mounts are not touched.
func (d *daemon) reload(ctx context.Context) {
	d.service.send("reloading")
	defer d.service.send("ready")
	rec := &config.Recorder{}
	cfg, err := config.LoadWith(d.opts.ConfigPath, d.opts.Registry.Decoders(), rec)
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
	if d.monitor != nil {
		if !d.reloadSplit(ctx, cfg, rec) {
			return
		}
	} else {
		opened, err := openSources(d.opts.Registry, d.sources, cfg, d.log, nil)
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
	}
	d.notifier.SetMounts(cfg.Mounts)
	d.admin.SetEndpoints(admin.Endpoints{Address: cfg.Admin, Socket: cfg.AdminSocket})
	d.level.Set(cfg.LogLevel)
	d.cfg.Sources, d.cfg.Mounts, d.cfg.LogLevel, d.cfg.ResyncInterval = cfg.Sources, cfg.Mounts, cfg.LogLevel, cfg.ResyncInterval
	d.cfg.Admin, d.cfg.AdminSocket = cfg.Admin, cfg.AdminSocket
	d.log.Info("configuration reloaded", "mounts", len(cfg.Mounts), "sources", len(cfg.Sources))
}

// webhookPoster is a notify.WebhookPoster of a function.
type webhookPoster func(ctx context.Context, w notify.Webhook) error

// PostWebhook implements notify.WebhookPoster.
func (f webhookPoster) PostWebhook(ctx context.Context, w notify.Webhook) error { return f(ctx, w) }
