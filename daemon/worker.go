package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"reflect"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/privsep"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/reconcile"
	"github.com/kvmount/kvmount/source"
)

// WorkerEnv is the environment variable that makes kvmount — or a test
// binary that calls MaybeWorker first — run as the worker: the monitor
// starts itself again (/proc/self/exe) with WorkerEnv=worker.
const WorkerEnv = "KVMOUNT_PRIVSEP"

// MaybeWorker runs the worker and exits when WorkerEnv says so; else it
// returns at once. main and the TestMain of packages that run the daemon
// call it first.
func MaybeWorker(registry *source.Registry) {
	if os.Getenv(WorkerEnv) != "worker" {
		return
	}
	if err := privsep.Harden(privsep.WorkerFD); err != nil {
		fmt.Fprintln(os.Stderr, "kvmount worker:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	err := RunWorker(ctx, privsep.WorkerConn(), registry)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvmount worker:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// afterConfine, when set, runs in the worker once it is confined, before
// it opens a source. Only tests set it (TestWorkerCannotEscape makes the
// worker try its ways out); in kvmount it is nil.
var afterConfine func(cfg *config.Config, log *slog.Logger)

// worker is the unprivileged half of the daemon: the sources, their cache
// and the populator, whose desired state it sends to the monitor.
type worker struct {
	registry *source.Registry
	link     *privsep.MonitorLink
	level    *slog.LevelVar
	log      *slog.Logger
	trigger  reconcile.Trigger
	cfg      *config.Config
	policy   privsep.Policy
	sources  map[string]instance
	cache    *source.Cache
	pop      *reconcile.Populator
	// sent is the desired mount last reported of each mount, and
	// payloadGen the generation whose payload was last sent.
	sent       map[string]*reconcile.DesiredMount
	payloadGen map[string]uint64
	// order is the configured mounts' names, sorted once per
	// configuration, not at every pass: the order publish reports them in.
	order []string
	// changed is the mounts the last Populate changed, through
	// takeChanged (publish); kept, so that an update allocates neither.
	changed     []string
	takeChanged func(name string)
	// sentBytes is the size of the payload last sent of each mount, and
	// sentTotal their sum: what overBound weighs a new payload against,
	// without a walk of every mount for each.
	sentBytes map[string]int64
	sentTotal int64
	// settled is set once every mount had a payload or an error.
	settled bool
	// heap gives the heap back after a burst of payloads sent, as the
	// monitor does after its bursts (heapRelease).
	heap *heapRelease
	// confined is set once the worker is confined: before, it delivers
	// no webhook.
	confined atomic.Bool
	// webhooks delivers the webhooks the monitor hands over.
	webhooks *http.Client
	// resends are the mounts whose payload the monitor asked for again
	// (privsep.Resend), until the loop rebuilds them.
	resendMu sync.Mutex
	resends  map[string]bool
	// onDisk is the digest of what each mount holds on disk, as the
	// monitor gave it (privsep.OnDisk), until the mount's next payload:
	// one of that digest is sent as a privsep.Unchanged instead.
	// resendMu guards it too.
	onDisk map[string]*privsep.OnDisk
}

// workerProcs returns the worker's GOMAXPROCS when the process would have
// procs: one less, at least one, so that the worker's runtime — whose idle
// threads spin for work each time one of its goroutines wakes — leaves a
// CPU to the monitor, which writes what the worker sends. A GOMAXPROCS
// the operator set (the monitor passes it on) is left alone.
func workerProcs(procs int) int { return max(1, procs-1) }

// applyRequest is an Apply with the inputs sent before it.
type applyRequest struct {
	apply  *privsep.Apply
	inputs map[string][]byte
}

// RunWorker runs the worker on conn, its socket to the monitor, until ctx
// is done or the monitor closes it: it takes its configuration from the
// monitor (Input, Apply), confines itself (privsep.Confine, with the
// policy of the configuration's stores) before it opens a source, and
// reports every mount's desired state and payload. It returns an error
// when its first configuration cannot be applied, or the link breaks the
// protocol.
func RunWorker(ctx context.Context, conn *os.File, registry *source.Registry) error {
	defer conn.Close()
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(workerProcs(runtime.GOMAXPROCS(0)))
	}
	w := &worker{
		registry: registry, link: privsep.NewMonitorLink(conn), level: new(slog.LevelVar),
		trigger: reconcile.NewTrigger(), sent: map[string]*reconcile.DesiredMount{}, payloadGen: map[string]uint64{}, sentBytes: map[string]int64{},
		webhooks: &http.Client{},
	}
	w.log = slog.New(w.link.Handler(w.level))
	// Before confinement: it reads the executable's mappings in /proc,
	// which the worker's Landlock ruleset closes.
	w.heap = newHeapRelease(w.log, 0)
	defer w.heap.stop()
	applies := make(chan applyRequest)
	readErr := make(chan error, 1)
	go func() {
		readErr <- w.link.Serve(ctx, privsep.MonitorHandlers{
			Apply: func(a *privsep.Apply, inputs map[string][]byte) {
				select {
				case applies <- applyRequest{apply: a, inputs: inputs}:
				case <-ctx.Done():
				}
			},
			Post:   w.post,
			Resend: w.askResend,
			OnDisk: w.setOnDisk,
		})
	}()
	defer w.close()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-readErr:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case req := <-applies:
			err := w.apply(req)
			msg := &privsep.Applied{Seq: req.apply.Seq}
			if err != nil {
				msg.Err = clip(err.Error(), privsep.MaxDetailLen)
			}
			if serr := w.link.Send(msg); serr != nil {
				return serr
			}
			if err != nil && w.cfg == nil {
				return err
			}
		case <-w.trigger:
		}
		if w.pop != nil {
			w.rebuildAsked()
			if err := w.publish(); err != nil {
				return err
			}
		}
	}
}

// post delivers the webhook m (notify.Deliver) and answers the monitor
// with how it went.
func (w *worker) post(ctx context.Context, m *privsep.Post) {
	answer := &privsep.Posted{Seq: m.Seq}
	if !w.confined.Load() {
		answer.Err = "webhook " + clip(m.Target, privsep.MaxNameLen) + ": the worker is not confined yet"
	} else if err := notify.Deliver(ctx, w.webhooks, notify.Webhook{URL: m.URL, Target: m.Target, Header: m.Header, Body: m.Body, Timeout: m.Timeout}); err != nil {
		answer.Err = clip(err.Error(), privsep.MaxDetailLen)
	}
	_ = w.link.Send(answer)
}

// askResend takes the monitor's request for mount's payload again
// (privsep.Resend), on the goroutine that reads the monitor: the loop
// has it rebuilt (rebuildAsked). At most one request per mount waits.
func (w *worker) askResend(mount string) {
	w.resendMu.Lock()
	if w.resends == nil {
		w.resends = map[string]bool{}
	}
	w.resends[mount] = true
	// Asked for whole: the monitor needs its bytes.
	delete(w.onDisk, mount)
	w.resendMu.Unlock()
	w.trigger.Fire()
}

// setOnDisk takes the monitor's word of the digest of what a mount holds
// on disk (privsep.OnDisk), on the goroutine that reads the monitor: one
// per mount is kept, until its next payload or a reload.
func (w *worker) setOnDisk(m *privsep.OnDisk) {
	w.resendMu.Lock()
	defer w.resendMu.Unlock()
	if w.onDisk == nil {
		w.onDisk = map[string]*privsep.OnDisk{}
	}
	w.onDisk[m.Mount] = m
}

// unchangedAs returns the Unchanged that stands for d, mount name's
// payload of size bytes, when its digest — as the monitor takes it
// (privsep.ConfiguredDigest) — is the one the monitor gave of the mount
// on disk; else nil. The digest given is forgotten either way: a later
// payload crosses whole.
func (w *worker) unchangedAs(name string, d *reconcile.DesiredMount, size int64) *privsep.Unchanged {
	w.resendMu.Lock()
	on := w.onDisk[name]
	delete(w.onDisk, name)
	w.resendMu.Unlock()
	if on == nil || privsep.ConfiguredDigest(d.Spec, int(on.UID), int(on.GID), d.Payload) != on.Digest {
		return nil
	}
	return &privsep.Unchanged{Mount: name, Generation: d.Generation, Digest: on.Digest, Size: uint64(size)}
}

// rebuildAsked has the populator build anew, from its snapshots, the
// payload of every mount the monitor asked for again; publish sends it
// as a new generation. A mount not configured is ignored.
func (w *worker) rebuildAsked() {
	w.resendMu.Lock()
	asked := w.resends
	w.resends = nil
	w.resendMu.Unlock()
	for mount := range asked {
		w.pop.Rebuild(mount)
	}
}

// apply runs the configuration req gives: the first one confines the
// worker and opens everything; a later one is a reload, as the in-process
// daemon's (changed sources reopened, mounts set). A configuration whose
// stores lie outside the worker's Landlock policy is refused: the monitor
// starts a new worker for it.
func (w *worker) apply(req applyRequest) error {
	text, ok := req.inputs[req.apply.Config]
	if !ok {
		return fmt.Errorf("no input %q holds the configuration", req.apply.Config)
	}
	cfg, err := config.ParseWith(req.apply.Config, text, w.registry.Decoders(), config.Replay(req.inputs))
	if err != nil {
		return err
	}
	policy, err := privsep.PolicyFor(cfg)
	if err != nil {
		return err
	}
	if w.cfg == nil {
		c, err := privsep.Confine(policy)
		if err != nil {
			return err
		}
		w.log.Info("worker confined", "uid", os.Getuid(), "landlock_abi", c.LandlockABI, "seccomp", c.Seccomp,
			"tcp_ports", fmt.Sprint(policy.ConnectTCP), "unix_sockets", fmt.Sprint(policy.UnixSockets))
		for _, warning := range confinementWarnings(c) {
			w.log.Warn("the worker runs with what the kernel offers (another user, no capability, no_new_privs)", "warning", warning)
		}
		w.confined.Store(true)
		if afterConfine != nil {
			afterConfine(cfg, w.log)
		}
		w.policy = policy
		w.cache = source.NewCache(w.log, w.trigger.Fire)
		w.pop = reconcile.NewPopulator(w.cache, w.log)
		w.pop.SetObserver(reconcile.ObserverFunc(w.forward))
		w.pop.WakeOnBuild(w.trigger.Fire)
	} else if !reflect.DeepEqual(policy, w.policy) {
		return errors.New("the configuration reaches stores outside the worker's Landlock policy; a new worker is needed")
	} else {
		// A reload: the monitor's digests on disk were of the mounts
		// as they were configured; their payloads cross whole.
		w.resendMu.Lock()
		clear(w.onDisk)
		w.resendMu.Unlock()
	}
	opened, err := openSources(w.registry, w.sources, cfg, w.log, w.link.Files())
	if err != nil {
		return err
	}
	w.cache.SetSources(sourceMap(opened))
	w.sources = opened
	if err := w.pop.SetMounts(cfg.Mounts); err != nil {
		return err
	}
	w.order = w.order[:0]
	for _, m := range cfg.Mounts {
		w.order = append(w.order, m.Name)
	}
	slices.Sort(w.order)
	w.level.Set(cfg.LogLevel)
	w.cfg = cfg
	w.trigger.Fire()
	return nil
}

// close stops the follows and closes the sources (the cache first, so
// that follows end as a stop, not as a release whose leases a source
// revokes: the next worker keeps them).
func (w *worker) close() {
	if w.cache != nil {
		w.cache.Close()
	}
	if w.pop != nil {
		w.pop.Close()
	}
}

// forward queues the populator's events that the monitor reports; they
// are called from Populate, and go with the mounts' states and payloads
// that publish sends after it, in one write where they fit.
func (w *worker) forward(ev reconcile.Event) {
	switch ev := ev.(type) {
	case reconcile.SourceEvent:
		st := &privsep.State{Source: ev.Source, Revision: boundRevision(ev.Revision)}
		if ev.Err != nil {
			st.Err = clip(ev.Err.Error(), privsep.MaxDetailLen)
		}
		_ = w.link.Queue(st)
	case reconcile.HeldBackEvent:
		_ = w.link.Queue(&privsep.HeldBack{Mount: ev.Mount, Guard: ev.Guard, Reason: clip(ev.Reason, privsep.MaxDetailLen), Revision: boundRevision(ev.Revision)})
	}
}

// publish sends the state of every mount whose desired state changed, and
// its payload when it has a new one, after the events Populate queued.
//
// It looks at the mounts the populator says its Populate changed
// (reconcile.ChangeReporter), at every mount only when the populator
// built the desired state anew: at 1,000 mounts a walk of every mount
// was two thousand map lookups on each update (not measured apart; the
// update beside 999 mounts is, BenchmarkPutToFileBeside999Mounts).
func (w *worker) publish() error {
	dsw := w.pop.Populate()
	if w.takeChanged == nil {
		w.takeChanged = func(name string) { w.changed = append(w.changed, name) }
	}
	w.changed = w.changed[:0]
	names := w.order
	if w.pop.Changed(w.takeChanged) {
		slices.Sort(w.changed)
		names = w.changed
	} else {
		for name := range w.sent {
			if dsw[name] == nil {
				delete(w.sent, name)
				delete(w.payloadGen, name)
				w.sentTotal -= w.sentBytes[name]
				delete(w.sentBytes, name)
			}
		}
	}
	for _, name := range names {
		d := dsw[name]
		if d == nil || w.sent[name] == d {
			continue
		}
		w.sent[name] = d
		st := mountState(name, d)
		if d.Ready() && w.payloadGen[name] != d.Generation {
			if guard, over := w.overBound(name, d); over != nil {
				// The monitor would refuse it as a breach: say why, and
				// which guard rail held it back.
				w.log.Error("cannot send mount payload; keeping last content", "mount", name, "err", over)
				st.Err = clip(over.Error(), privsep.MaxDetailLen)
				if err := w.link.Queue(&privsep.HeldBack{Mount: name, Guard: guard, Reason: st.Err, Revision: boundRevision(d.Revision)}); err != nil {
					return err
				}
			} else {
				w.payloadGen[name] = d.Generation
				size := d.Payload.Size()
				w.sentTotal += size - w.sentBytes[name]
				w.sentBytes[name] = size
				if u := w.unchangedAs(name, d, size); u != nil {
					// What the mount holds on disk already: its
					// digest crosses, not its bytes.
					if err := w.link.Queue(st, u); err != nil {
						return err
					}
				} else if err := w.link.QueuePayload(st, d.Payload); err != nil {
					return err
				}
				w.heap.Payload()
				// The monitor holds it now; the worker builds the next
				// one from the snapshots, not from this.
				w.pop.ReleasePayload(name)
				continue
			}
		}
		if err := w.link.Queue(st); err != nil {
			return err
		}
	}
	// One write for all of it where it fits: every wake-up of the monitor
	// is a cross-process one.
	if err := w.link.Flush(); err != nil {
		return err
	}
	if !w.settled && allBuilt(dsw) {
		// As the monitor does once its mounts are projected (service):
		// the first snapshots and payloads of every mount are most of the
		// garbage the worker will ever make; it goes back to the system
		// now, not when the runtime's scavenger gets to it.
		w.settled = true
		w.heap.now("the first payloads")
	}
	return nil
}

// overBound returns why d's payload for mount name cannot be sent, and
// the guard rail that holds it back, as
// the monitor would refuse it while it arrives (privsep.Assembler): on
// tmpfs it does not fit size_limit; or with the payloads last sent of the
// other mounts it passes max_total_size (privsep.Remote.Budget). nil when
// it fits.
func (w *worker) overBound(name string, d *reconcile.DesiredMount) (guard string, _ error) {
	if d.Spec.Medium == config.MediumTmpfs {
		if err := (projector.Medium{Tmpfs: true, SizeLimit: d.Spec.SizeLimit}).CheckFits(d.Payload); err != nil {
			return "size_limit", fmt.Errorf("mount %q: %w", name, err)
		}
	}
	size := d.Payload.Size()
	total := w.sentTotal - w.sentBytes[name] + size
	if total <= w.cfg.MaxTotalSize {
		return "", nil
	}
	return "max_total_size", fmt.Errorf("mount %q: a payload of %d bytes takes the payloads of every mount together to %d bytes, past max_total_size (%d bytes)",
		name, size, total, w.cfg.MaxTotalSize)
}

// mountState returns the report of d, mount name's desired state, within
// the protocol's bounds. What a list cannot hold is said, not dropped:
// sources waiting past MaxListLen are counted in a last stale entry, and
// stale entries past it in "and N more".
func mountState(name string, d *reconcile.DesiredMount) *privsep.MountState {
	st := &privsep.MountState{Mount: name, Generation: d.Generation, Revision: boundRevision(d.Revision), Waiting: d.Waiting}
	if d.Err != nil {
		st.Err = clip(d.Err.Error(), privsep.MaxDetailLen)
	}
	stale := make([]string, 0, len(d.Stale)+1)
	for _, err := range d.Stale {
		stale = append(stale, clip(err.Error(), privsep.MaxDetailLen))
	}
	if n := len(d.Waiting) - privsep.MaxListLen; n > 0 {
		st.Waiting = d.Waiting[:privsep.MaxListLen]
		stale = append(stale, fmt.Sprintf("%d more sources have no snapshot yet (only %d are named)", n, privsep.MaxListLen))
	}
	if len(stale) > 0 {
		st.Stale = boundList(stale)
	}
	return st
}

// boundList returns list if it has at most MaxListLen strings, else its
// first MaxListLen-1 and "and N more".
func boundList(list []string) []string {
	if len(list) <= privsep.MaxListLen {
		return list
	}
	keep := privsep.MaxListLen - 1
	return append(list[:keep:keep], fmt.Sprintf("and %d more", len(list)-keep))
}

// allBuilt reports whether every mount of dsw has a payload or an error.
func allBuilt(dsw reconcile.DesiredState) bool {
	for _, d := range dsw {
		if !d.Ready() && d.Err == nil {
			return false
		}
	}
	return true
}

// boundRevision returns a mount's revision within the protocol's bound:
// as it is, or its digest (source.BoundRevision).
func boundRevision(rev string) string {
	if len(rev) <= privsep.MaxRevisionLen {
		return rev
	}
	return source.BoundRevision(rev)
}

// clip returns s cut to at most n bytes (privsep.Clip).
func clip(s string, n int) string { return privsep.Clip(s, n) }
