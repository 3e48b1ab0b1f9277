package daemon

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"syscall"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/privsep"
)

// workerCommand returns the command of the worker of domain: this very
// program (/proc/self/exe, whatever replaced its file since), with
// WorkerEnv set to mode, in /, in a process group of its own (a
// terminal's signals are the monitor's to pass on), with an environment
// of its own; ps shows it as "kvmount-worker DOMAIN".
func workerCommand(mode, domain string) *exec.Cmd {
	cmd := exec.Command("/proc/self/exe")
	cmd.Args = []string{"kvmount-worker", domain}
	cmd.Dir = "/"
	cmd.Env = []string{WorkerEnv + "=" + mode, "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	for _, name := range workerRuntimeEnv {
		if v, ok := os.LookupEnv(name); ok {
			cmd.Env = append(cmd.Env, name+"="+v)
		}
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd
}

// workerRuntimeEnv are the variables of the monitor's environment a worker
// inherits: the Go runtime's own settings (the runtime package's
// documentation), which an operator sets for kvmount as a whole — in the
// unit's Environment=, say GOMEMLIMIT or GOGC to trade CPU for memory —
// and which reach each worker as they are (each process its own soft
// memory limit), and the race detector's options for tests. Nothing else
// of the environment does.
var workerRuntimeEnv = []string{"GOGC", "GOMEMLIMIT", "GODEBUG", "GOMAXPROCS", "GORACE"}

// monitor is the privileged half's link to its workers, one per trust
// domain (privsep.Monitor), and what the kernel lets them confine
// themselves with.
type monitor struct {
	*privsep.Monitor
	offered privsep.Confinement
}

// newMonitor returns the monitor of cfg, whose files rec read, with the
// workers opts say (Options.WorkerGroup), each as a user of its own
// (dynamicUsers); they start when it runs. Close gives their users back.
// onPayload, if not nil, is called after each payload taken from a worker
// (privsep.MonitorOptions.OnPayload).
func newMonitor(log *slog.Logger, cfg *config.Config, rec *config.Recorder, opts Options, onPayload func()) (*monitor, error) {
	users, err := newDynamicUsers(opts.WorkerGroup)
	if err != nil {
		return nil, err
	}
	mode := opts.workerMode
	if mode == "" {
		mode = "worker"
	}
	m := &monitor{offered: privsep.Offered(), Monitor: privsep.NewMonitor(privsep.MonitorOptions{
		Log: log, Identities: users.take, Kinds: opts.Registry.Decoders(),
		Command:   func(domain string) *exec.Cmd { return workerCommand(mode, domain) },
		OnPayload: onPayload,
	})}
	if err := m.Remote().SetMounts(cfg.Mounts); err != nil {
		return nil, err
	}
	if err := m.Configure(context.Background(), cfg, inputs(cfg, rec)); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

// inputs returns the files the monitor read for cfg (rec), and cfg's own
// text, by name: what the workers' shares are cut from.
func inputs(cfg *config.Config, rec *config.Recorder) map[string][]byte {
	in := rec.Recorded()
	in[cfg.Path] = cfg.Text
	return in
}

// run runs the workers until ctx is done.
func (m *monitor) run(ctx context.Context) error {
	err := m.Run(ctx)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// workersRun is a monitor's run of its workers in the background.
type workersRun struct {
	cancel context.CancelFunc
	done   chan struct{}
	// err is monitor.run's, once done is closed.
	err error
}

// startWorkers starts m's workers, each reading its sources, before the
// reconciler is made: the start's other work — the host's audit, the
// reading of every manifest's head — took 28 ms of a 1,000-mount restart
// that the workers waited for (BENCHMARKS.md, "A restart's passes
// paced"). What they report waits in m's desired state (privsep.Remote)
// for the reconciler's first pass.
func startWorkers(m *monitor) *workersRun {
	ctx, cancel := context.WithCancel(context.Background())
	w := &workersRun{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		w.err = m.run(ctx)
	}()
	return w
}

// wait returns the run's error if it ends by itself (a worker's identity
// refused), or nil once ctx is done and the workers have stopped.
func (w *workersRun) wait(ctx context.Context) error {
	select {
	case <-w.done:
		return w.err
	case <-ctx.Done():
		w.stop()
		return nil
	}
}

// stop stops the workers and waits until they have.
func (w *workersRun) stop() {
	w.cancel()
	<-w.done
}
