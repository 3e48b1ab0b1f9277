package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
	"github.com/kvmount/kvmount/source"
)

// Render reads the sources of the mount named mount once and builds its
// payload — keys and templates, with every limit (max_value_size,
// max_mount_size, a tmpfs's size_limit) and min_keys — without touching
// the mount or taking the state directory's lock: a dry run of what the
// daemon would write. As the daemon does, it has an unprivileged worker
// read the sources and render the templates, and checks what the worker
// sends (privsep.Assembler); the worker reads the sources of every mount
// of the configuration. With Options.InProcess it reads them itself. It
// returns the payload, or an error: the configuration's, an unknown
// mount, the payload's (a missing key, a template error, a limit), or no
// snapshot within timeout. check_command is not run (it needs a version
// directory on disk).
func Render(ctx context.Context, opts Options, mount string, timeout time.Duration) (projector.Payload, error) {
	rec := &config.Recorder{}
	cfg, err := config.LoadWith(opts.ConfigPath, opts.Registry.Decoders(), rec)
	if err != nil {
		return nil, err
	}
	var spec *config.Mount
	for _, m := range cfg.Mounts {
		if m.Name == mount {
			spec = m
		}
	}
	if spec == nil {
		names := make([]string, len(cfg.Mounts))
		for i, m := range cfg.Mounts {
			names[i] = m.Name
		}
		return nil, fmt.Errorf("render: no mount %q in %s (mounts: %s)", mount, opts.ConfigPath, strings.Join(names, ", "))
	}
	log := NewLogger(opts.LogOutput, cfg.LogFormat, cfg.LogLevel)
	trigger := reconcile.NewTrigger()
	var desired reconcile.Desired
	if opts.InProcess {
		pop, closeAll, err := renderInProcess(opts, cfg, spec, log, trigger)
		if err != nil {
			return nil, err
		}
		defer closeAll()
		desired = pop
	} else {
		// The worker of spec's domain alone.
		m, err := newMonitor(log, narrowTo(cfg, spec), rec, opts, nil)
		if err != nil {
			return nil, err
		}
		m.Remote().WakeOnBuild(trigger.Fire)
		runCtx, stop := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			if err := m.run(runCtx); err != nil {
				log.Error("the worker cannot run", "err", err)
			}
		}()
		defer func() {
			stop()
			<-done
			m.Close()
		}()
		desired = m.Remote()
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		d := desired.Populate()[mount]
		switch {
		case d.Err != nil:
			return nil, d.Err
		case d.Ready():
			if len(d.Payload) < spec.MinKeys {
				return nil, fmt.Errorf("mount %q: the payload has %d files, fewer than min_keys (%d)", mount, len(d.Payload), spec.MinKeys)
			}
			m := projector.Medium{Tmpfs: spec.Medium == config.MediumTmpfs, SizeLimit: spec.SizeLimit}
			if err := m.CheckFits(d.Payload); err != nil {
				return nil, fmt.Errorf("mount %q: %w", mount, err)
			}
			return d.Payload, nil
		}
		select {
		case <-trigger:
		case <-ctx.Done():
			why := fmt.Sprintf("no snapshot from %s within %v", strings.Join(d.Waiting, ", "), timeout)
			if len(d.Stale) > 0 {
				why = fmt.Sprintf("%v (%s)", why, d.Stale[0])
			}
			return nil, fmt.Errorf("mount %q: %s", mount, why)
		}
	}
}

// narrowTo returns cfg with spec as its only mount, and the sources spec
// reads as its only sources.
func narrowTo(cfg *config.Config, spec *config.Mount) *config.Config {
	c := *cfg
	c.Mounts = []*config.Mount{spec}
	c.Sources = map[string]*config.Source{}
	for _, pr := range spec.Projections {
		c.Sources[pr.Source] = cfg.Sources[pr.Source]
	}
	return &c
}

// renderInProcess opens the sources of spec and returns a populator of
// spec alone, and what closes them.
func renderInProcess(opts Options, cfg *config.Config, spec *config.Mount, log *slog.Logger, trigger reconcile.Trigger) (*reconcile.Populator, func(), error) {
	cache := source.NewCache(log, trigger.Fire)
	sources := map[string]source.Source{}
	for _, pr := range spec.Projections {
		if _, ok := sources[pr.Source]; ok {
			continue
		}
		src, err := opts.Registry.Open(cfg.Sources[pr.Source], source.Env{Log: log})
		if err != nil {
			for _, s := range sources {
				s.Close()
			}
			cache.Close()
			return nil, nil, err
		}
		sources[pr.Source] = src
	}
	cache.SetSources(sources)
	pop := reconcile.NewPopulator(cache, log)
	pop.WakeOnBuild(trigger.Fire)
	closeAll := func() {
		pop.Close()
		cache.Close()
	}
	if err := pop.SetMounts([]*config.Mount{spec}); err != nil {
		closeAll()
		return nil, nil, err
	}
	return pop, closeAll, nil
}
