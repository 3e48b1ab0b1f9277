package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"os/signal"
	"reflect"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

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
	send     *sender
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
	// sentBytes is the size of the payload last sent of each mount.
	sentBytes map[string]int64
	rereads   *rereads
	// settled is set once every mount had a payload or an error.
	settled bool
	// confined is set once the worker is confined: before, it delivers
	// no webhook.
	confined atomic.Bool
	// webhooks delivers the webhooks the monitor hands over.
	webhooks *http.Client
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
		registry: registry, send: &sender{enc: privsep.NewEncoder(conn)}, level: new(slog.LevelVar),
		trigger: reconcile.NewTrigger(), sent: map[string]*reconcile.DesiredMount{}, payloadGen: map[string]uint64{}, sentBytes: map[string]int64{},
		webhooks: &http.Client{},
	}
	w.rereads = &rereads{send: w.send, waiting: map[string][]chan *privsep.Credential{}}
	w.log = slog.New(&workerHandler{send: w.send, level: w.level})
	applies := make(chan applyRequest)
	readErr := make(chan error, 1)
	go func() { readErr <- w.read(ctx, conn, applies) }()
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
			if serr := w.send.send(msg); serr != nil {
				return serr
			}
			if err != nil && w.cfg == nil {
				return err
			}
		case <-w.trigger:
		}
		if w.pop != nil {
			if err := w.publish(); err != nil {
				return err
			}
		}
	}
}

// read decodes the monitor's messages: Inputs gathered until an Apply,
// Credentials handed to the reads waiting for them, webhooks delivered
// each on a goroutine of its own, until ctx is done.
func (w *worker) read(ctx context.Context, r io.Reader, applies chan<- applyRequest) error {
	d := privsep.NewDecoder(r, privsep.FromMonitor)
	inputs := map[string][]byte{}
	for {
		m, err := d.Decode()
		if err != nil {
			return err
		}
		switch m := m.(type) {
		case *privsep.Input:
			inputs[m.Name] = m.Value
		case *privsep.Apply:
			applies <- applyRequest{apply: m, inputs: inputs}
			inputs = map[string][]byte{}
		case *privsep.Credential:
			w.rereads.answer(m)
		case *privsep.Post:
			go w.post(ctx, m)
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
	_ = w.send.send(answer)
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
	}
	opened, err := openSources(w.registry, w.sources, cfg, w.log, w.rereads)
	if err != nil {
		return err
	}
	w.cache.SetSources(sourceMap(opened))
	w.sources = opened
	if err := w.pop.SetMounts(cfg.Mounts); err != nil {
		return err
	}
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
		_ = w.send.queue(st)
	case reconcile.HeldBackEvent:
		_ = w.send.queue(&privsep.HeldBack{Mount: ev.Mount, Guard: ev.Guard, Reason: clip(ev.Reason, privsep.MaxDetailLen), Revision: boundRevision(ev.Revision)})
	}
}

// publish sends the state of every mount whose desired state changed, and
// its payload when it has a new one, after the events Populate queued.
func (w *worker) publish() error {
	dsw := w.pop.Populate()
	for name := range w.sent {
		if dsw[name] == nil {
			delete(w.sent, name)
			delete(w.payloadGen, name)
			delete(w.sentBytes, name)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(dsw)) {
		d := dsw[name]
		if w.sent[name] == d {
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
				if err := w.send.queue(&privsep.HeldBack{Mount: name, Guard: guard, Reason: st.Err, Revision: boundRevision(d.Revision)}); err != nil {
					return err
				}
			} else {
				w.payloadGen[name] = d.Generation
				w.sentBytes[name] = d.Payload.Size()
				if err := w.send.payload(st, d); err != nil {
					return err
				}
				continue
			}
		}
		if err := w.send.queue(st); err != nil {
			return err
		}
	}
	// One write for all of it where it fits: every wake-up of the monitor
	// is a cross-process one.
	if err := w.send.flush(); err != nil {
		return err
	}
	if !w.settled && allBuilt(dsw) {
		// As the monitor does once its mounts are projected (service):
		// the first snapshots and payloads of every mount are most of the
		// garbage the worker will ever make; it goes back to the system
		// now, not when the runtime's scavenger gets to it.
		w.settled = true
		go debug.FreeOSMemory()
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
	total := size
	for m, n := range w.sentBytes {
		if m != name {
			total += n
		}
	}
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

// clip returns s cut to at most n bytes.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// sender writes the worker's messages to the monitor, from any goroutine.
type sender struct {
	mu  sync.Mutex
	enc *privsep.Encoder
}

// send writes msgs and flushes them.
func (s *sender) send(msgs ...privsep.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.encode(msgs); err != nil {
		return err
	}
	return s.enc.Flush()
}

// queue writes msgs without flushing them: they go with the next flush,
// or the next send.
func (s *sender) queue(msgs ...privsep.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.encode(msgs)
}

// encode encodes msgs; s.mu is held.
func (s *sender) encode(msgs []privsep.Message) error {
	for _, m := range msgs {
		if err := s.enc.Encode(m); err != nil {
			return err
		}
	}
	return nil
}

// flush writes what was queued.
func (s *sender) flush() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.enc.Flush()
}

// payload queues st and then d's payload, its files in path order (they
// are written as the encoder's buffer fills, the rest at the next flush).
func (s *sender) payload(st *privsep.MountState, d *reconcile.DesiredMount) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.enc.Encode(st); err != nil {
		return err
	}
	if err := s.enc.Encode(&privsep.Begin{Mount: st.Mount, Revision: st.Revision, Files: uint32(len(d.Payload))}); err != nil {
		return err
	}
	for _, p := range slices.Sorted(maps.Keys(d.Payload)) {
		f := d.Payload[p]
		if err := s.enc.EncodeFile(p, uint32(f.Mode.Perm()), f.Data); err != nil {
			return err
		}
	}
	return s.enc.Encode(&privsep.Commit{})
}

// rereadTimeout bounds the wait for the monitor's answer to a Reread.
const rereadTimeout = 10 * time.Second

// rereads is the worker's config.Files for the credential files a source
// reads again while it runs: each read is a Reread to the monitor, which
// answers with the file's content or why it cannot.
type rereads struct {
	send    *sender
	mu      sync.Mutex
	waiting map[string][]chan *privsep.Credential
	// asked holds the files asked for whose answer has not come: the
	// monitor takes one request per file in flight, so a read of a file
	// already asked for waits for that answer.
	asked map[string]bool
}

// Read implements config.Files.
func (r *rereads) Read(name string, limit int64) ([]byte, *unix.Stat_t, error) {
	ch := make(chan *privsep.Credential, 1)
	r.mu.Lock()
	r.waiting[name] = append(r.waiting[name], ch)
	ask := !r.asked[name]
	if ask {
		if r.asked == nil {
			r.asked = map[string]bool{}
		}
		r.asked[name] = true
	}
	r.mu.Unlock()
	if ask {
		if err := r.send.send(&privsep.Reread{Name: name}); err != nil {
			r.mu.Lock()
			delete(r.asked, name)
			r.mu.Unlock()
			r.forget(name, ch)
			return nil, nil, err
		}
	}
	select {
	case c := <-ch:
		if c.Err != "" {
			return nil, nil, errors.New(c.Err)
		}
		return config.Replay{name: c.Value}.Read(name, limit)
	case <-time.After(rereadTimeout):
		r.forget(name, ch)
		return nil, nil, fmt.Errorf("%s: the monitor did not answer within %v", name, rereadTimeout)
	}
}

// forget removes ch, a read that gave up, from those waiting for name.
func (r *rereads) forget(name string, ch chan *privsep.Credential) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.waiting[name] = slices.DeleteFunc(r.waiting[name], func(c chan *privsep.Credential) bool { return c == ch })
	if len(r.waiting[name]) == 0 {
		delete(r.waiting, name)
	}
}

// answer hands c to the reads waiting for its file.
func (r *rereads) answer(c *privsep.Credential) {
	r.mu.Lock()
	chans := r.waiting[c.Name]
	delete(r.waiting, c.Name)
	delete(r.asked, c.Name)
	r.mu.Unlock()
	for _, ch := range chans {
		ch <- c
	}
}

// workerHandler is the worker's slog.Handler: each record goes to the
// monitor as a Log message, its attributes as strings, which the monitor
// logs with its own handler (escaping them).
type workerHandler struct {
	send  *sender
	level slog.Leveler
	attrs []string
	group string
}

func (h *workerHandler) Enabled(_ context.Context, l slog.Level) bool {
	return l >= h.level.Level()
}

func (h *workerHandler) Handle(_ context.Context, r slog.Record) error {
	attrs := slices.Clone(h.attrs)
	r.Attrs(func(a slog.Attr) bool {
		attrs = appendAttr(attrs, h.group, a)
		return true
	})
	if len(attrs) > privsep.MaxListLen {
		// Keys and values go in pairs: the last pair says how many
		// were left out.
		keep := privsep.MaxListLen - 2
		attrs = append(attrs[:keep:keep], "attrs_dropped", strconv.Itoa((len(attrs)-keep)/2))
	}
	return h.send.send(&privsep.Log{Level: int32(r.Level), Message: clip(r.Message, privsep.MaxDetailLen), Attrs: attrs})
}

func (h *workerHandler) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	c.attrs = slices.Clone(h.attrs)
	for _, a := range as {
		c.attrs = appendAttr(c.attrs, h.group, a)
	}
	return &c
}

func (h *workerHandler) WithGroup(name string) slog.Handler {
	c := *h
	c.group = h.group + name + "."
	return &c
}

// appendAttr appends a's key, with group before it, and its value as a
// string; a group's attributes one by one.
func appendAttr(out []string, group string, a slog.Attr) []string {
	v := a.Value.Resolve()
	if v.Kind() == slog.KindGroup {
		for _, g := range v.Group() {
			out = appendAttr(out, group+a.Key+".", g)
		}
		return out
	}
	var s string
	if err, ok := v.Any().(error); ok && v.Kind() == slog.KindAny {
		s = err.Error()
	} else {
		s = v.String()
	}
	return append(out, clip(group+a.Key, privsep.MaxDetailLen), clip(s, privsep.MaxDetailLen))
}
