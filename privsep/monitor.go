package privsep

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os/exec"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/notify"
)

// MonitorOptions configure a Monitor.
type MonitorOptions struct {
	// Log receives the monitor's lines and its workers' relayed ones; its
	// handler must escape outside text (untrusted.Escape), as the
	// daemon's does.
	Log *slog.Logger
	// Identities gives the worker of each trust domain the user and
	// group it runs as — a user of its own, so that nothing the kernel
	// grants a user (its RLIMIT_NPROC count, signals, prlimit(2)) spans
	// two domains — and the function that gives them back once that
	// worker is gone for good. It is called once per domain, when the
	// domain first appears in a configuration; an error refuses that
	// configuration.
	Identities func(domain string) (id Identity, release func(), err error)
	// Command returns the command of the worker of the domain named, a
	// new one for every start; its output and ExtraFiles are the
	// monitor's to set.
	Command func(domain string) *exec.Cmd
	// Kinds are the source kinds' decoders: the monitor parses each
	// domain's excerpt of the configuration as its worker will.
	Kinds map[string]config.SourceDecoder
	// OnPayload, if set, is called after each payload a worker sent has
	// been taken (Remote.HandlePayload), on the goroutine that reads that
	// worker: it must not block.
	OnPayload func()
}

// Monitor is the monitor's side of the seam: one worker per trust domain
// of the configuration (Domains), each run by a Supervisor of its own,
// given its domain's excerpt of the configuration and files alone, and
// served through the request table (requests.go); and the desired state
// their reports build (Remote). A worker's payloads and reports are taken
// for the mounts and sources of its domain only. It is safe for
// concurrent use.
type Monitor struct {
	opts   MonitorOptions
	remote *Remote

	mu      sync.Mutex
	workers map[string]*domainWorker
	// domainOf is the domain of each mount, for webhooks.
	domainOf map[string]string
	// ctx is Run's while it runs, nil before: a worker added then starts
	// at once.
	ctx   context.Context
	runs  sync.WaitGroup
	fatal chan error
}

// NewMonitor returns a monitor with no worker: Configure gives it its
// configuration, Run runs the workers.
func NewMonitor(opts MonitorOptions) *Monitor {
	m := &Monitor{opts: opts, remote: NewRemote(), workers: map[string]*domainWorker{}, domainOf: map[string]string{}, fatal: make(chan error, 1)}
	m.remote.SetSend(m.send)
	return m
}

// send queues msgs to the worker of domain (Supervisor.Send), and reports
// whether one runs to take them.
func (m *Monitor) send(domain string, msgs ...Message) bool {
	m.mu.Lock()
	w := m.workers[domain]
	m.mu.Unlock()
	return w != nil && w.super.Send(msgs...)
}

// Remote returns the desired state the workers' reports build.
func (m *Monitor) Remote() *Remote { return m.remote }

// domainWorker is the worker of one trust domain, and what the monitor
// keeps of the requests it made.
type domainWorker struct {
	m *Monitor
	// domain is its domain as it began: its name and sources stay, its
	// mounts are mounts.
	domain Domain
	super  *Supervisor
	// release gives back its identity (MonitorOptions.Identities).
	release func()
	// cfg is the configuration it runs, or is to run when it starts, and
	// mounts the mounts of its domain in it (Monitor.mu guards both);
	// policy its Landlock and seccomp policy.
	cfg    Configuration
	mounts []string
	policy atomic.Pointer[Policy]
	// files are the credential files it may ask for (Reread).
	files atomic.Pointer[[]string]
	// cancel stops its supervisor's Run; done is closed when Run has
	// returned. Both are nil until it starts.
	cancel context.CancelFunc
	done   chan struct{}

	mu sync.Mutex
	// asked are the credential files asked for whose answer is not
	// written yet; rereads paces the reads.
	asked   map[string]bool
	rereads *rate.Limiter
	// postSeq numbers the webhooks handed to it; posts are those
	// waiting for its answer, by Seq (nil once the delivery gave up).
	postSeq uint32
	posts   map[uint32]chan string
	// relayed paces its log lines; dropped counts those held back since
	// the last relayed one.
	relayed *rate.Limiter
	dropped int
}

// planned is a domain's share of a configuration.
type planned struct {
	domain Domain
	cfg    Configuration
	policy Policy
	files  []string
}

// plan returns each domain's share of cfg, whose files the monitor read
// (inputs, by name).
func (m *Monitor) plan(cfg *config.Config, inputs map[string][]byte) (map[string]planned, error) {
	out := map[string]planned{}
	for name, d := range ConfigDomains(cfg) {
		c, part, err := DomainConfiguration(cfg, inputs, m.opts.Kinds, d)
		if err != nil {
			return nil, err
		}
		policy, err := PolicyFor(part)
		if err != nil {
			return nil, err
		}
		out[name] = planned{domain: d, cfg: c, policy: policy, files: rereadFiles(part)}
	}
	return out, nil
}

// rereadFiles returns the credential files cfg's sources read again while
// they run (config.RereadFiles).
func rereadFiles(cfg *config.Config) []string {
	var names []string
	for _, src := range cfg.Sources {
		if r, ok := src.Settings.(config.RereadFiles); ok {
			names = append(names, r.RereadFiles()...)
		}
	}
	return names
}

// Configure makes cfg, whose files the monitor read (inputs, by name),
// the configuration the workers run: each trust domain's worker is given
// its excerpt (DomainConfiguration). A domain that stays, with the same
// policy, is handed its new share and waited for, until ctx is done;
// when one of them refuses it, those that took theirs are given the one
// before back and Configure returns an error wrapping ErrNotApplied —
// the running configuration stays in force. Then a domain whose policy
// changed gets a new worker, a new domain its first, and the worker of a
// domain that is gone stops. It returns an error when a domain's excerpt
// does not parse or its policy cannot be made. max_total_size bounds the
// payloads from then on (Remote.SetMaxTotal).
func (m *Monitor) Configure(ctx context.Context, cfg *config.Config, inputs map[string][]byte) error {
	plans, err := m.plan(cfg, inputs)
	if err != nil {
		return err
	}
	m.mu.Lock()
	current := maps.Clone(m.workers)
	m.mu.Unlock()

	// Each new domain's worker is given its user before any worker takes
	// a share: a configuration some new domain finds no user for is
	// refused, the running one untouched.
	fresh := map[string]identity{}
	releaseFresh := func() {
		for _, id := range fresh {
			id.release()
		}
	}
	for _, name := range slices.Sorted(maps.Keys(plans)) {
		if current[name] != nil {
			continue
		}
		id, release, err := m.opts.Identities(name)
		if err != nil {
			releaseFresh()
			return fmt.Errorf("domain %s: no user for its worker: %w", name, err)
		}
		if release == nil {
			release = func() {}
		}
		fresh[name] = identity{id, release}
	}

	// The workers that stay and keep their policy take the new shares
	// first, together: any of them may refuse.
	type handed struct {
		w         *domainWorker
		prev      Configuration
		prevFiles []string
		err       error
	}
	var kept []*handed
	for name, p := range plans {
		if w := current[name]; w != nil && reflect.DeepEqual(*w.policy.Load(), p.policy) {
			kept = append(kept, &handed{w: w, prev: w.cfg, prevFiles: *w.files.Load()})
		}
	}
	var wg sync.WaitGroup
	for _, h := range kept {
		p := plans[h.w.domain.Name]
		// Until it runs the new share, it may ask for the files of
		// either.
		h.w.setFiles(append(slices.Clone(h.prevFiles), p.files...))
		wg.Add(1)
		go func() {
			defer wg.Done()
			h.err = h.w.super.Configure(ctx, p.cfg, false)
		}()
	}
	wg.Wait()
	var refused []error
	for _, h := range kept {
		if h.err != nil {
			refused = append(refused, fmt.Errorf("domain %s: %w", h.w.domain.Name, h.err))
		}
	}
	if len(refused) > 0 {
		back, cancel := context.WithTimeout(context.WithoutCancel(ctx), applyTimeout)
		defer cancel()
		for _, h := range kept {
			if h.err == nil {
				if err := h.w.super.Configure(back, h.prev, false); err != nil {
					m.opts.Log.Error("the worker of a domain cannot take the running configuration back", "domain", h.w.domain.Name, "err", err)
				}
			}
			h.w.setFiles(h.prevFiles)
		}
		releaseFresh()
		return errors.Join(refused...)
	}

	m.mu.Lock()
	var stop []*domainWorker
	for _, h := range kept {
		p := plans[h.w.domain.Name]
		h.w.cfg, h.w.mounts = p.cfg, p.domain.Mounts
		h.w.setFiles(p.files)
	}
	for name, p := range plans {
		w := current[name]
		switch {
		case w == nil:
			m.workers[name] = m.newWorker(p, fresh[name])
			if m.ctx != nil {
				m.start(m.workers[name])
			}
		case !reflect.DeepEqual(*w.policy.Load(), p.policy):
			// A running worker cannot widen its confinement: a new one
			// runs the new share.
			w.cfg, w.mounts = p.cfg, p.domain.Mounts
			w.setFiles(p.files)
			w.policy.Store(&p.policy)
			_ = w.super.Configure(ctx, p.cfg, true)
			m.opts.Log.Info("the configuration reaches other stores: the worker of the domain starts again with them", "domain", name)
		}
	}
	for name, w := range current {
		if _, ok := plans[name]; !ok {
			delete(m.workers, name)
			stop = append(stop, w)
		}
	}
	m.domainOf, _ = mountDomains(ConfigDomains(cfg))
	m.mu.Unlock()
	m.remote.SetMaxTotal(cfg.MaxTotalSize)
	for _, w := range stop {
		// In the background: nothing of the new configuration waits for
		// it.
		go func() {
			w.stop()
			w.release()
			m.opts.Log.Info("no mount or source of the configuration is of the domain any more: its worker stopped", "domain", w.domain.Name)
		}()
	}
	return nil
}

// applyTimeout bounds the wait for a worker to take back the
// configuration it ran, after another worker refused a new one.
const applyTimeout = 30 * time.Second

// setFiles makes names the credential files w may ask for.
func (w *domainWorker) setFiles(names []string) { w.files.Store(&names) }

// identity is a worker's user and group, and what gives them back.
type identity struct {
	Identity
	release func()
}

// newWorker returns the worker of p's domain, to run as id, not started.
func (m *Monitor) newWorker(p planned, id identity) *domainWorker {
	w := &domainWorker{m: m, domain: p.domain, cfg: p.cfg, mounts: p.domain.Mounts, release: sync.OnceFunc(id.release),
		asked: map[string]bool{}, posts: map[uint32]chan string{},
		rereads: rate.NewLimiter(rereadRate, rereadBurst), relayed: rate.NewLimiter(RelayRate, RelayBurst)}
	w.policy.Store(&p.policy)
	w.setFiles(p.files)
	log := m.opts.Log.With("domain", p.domain.Name)
	w.super = &Supervisor{
		Command: func() *exec.Cmd {
			cmd := m.opts.Command(p.domain.Name)
			// What the worker writes outside the protocol (a runtime's
			// panic) is logged a line at a time, escaped, never passed
			// on raw.
			out := &lineLog{log: log}
			cmd.Stdout, cmd.Stderr = out, out
			return cmd
		},
		Identity: id.Identity,
		Log:      log,
		OnPayload: func(pl *Payload) {
			m.remote.HandlePayload(p.domain.Name, pl)
			if m.opts.OnPayload != nil {
				m.opts.OnPayload()
			}
		},
		OnMessage: w.serve,
		OnStart:   func() []Message { return m.remote.StartMessages(p.domain.Name) },
		OnIdle:    m.remote.Idle,
		OnEnd:     w.ended,
		OnWritten: w.written,
		Budget:    m.remote.Budget,
	}
	// The configuration it runs from its first start: Configure with no
	// worker running returns at once.
	_ = w.super.Configure(context.Background(), p.cfg, false)
	return w
}

// start runs w's supervisor until m's Run ends or w stops; m.mu is held.
func (m *Monitor) start(w *domainWorker) {
	ctx, cancel := context.WithCancel(m.ctx)
	w.cancel, w.done = cancel, make(chan struct{})
	m.runs.Add(1)
	go func() {
		defer m.runs.Done()
		defer close(w.done)
		if err := w.super.Run(ctx); err != nil && ctx.Err() == nil {
			select {
			case m.fatal <- err:
			default:
			}
		}
	}()
}

// stop stops w's worker and waits for it to end.
func (w *domainWorker) stop() {
	if w.cancel == nil {
		return
	}
	w.cancel()
	<-w.done
}

// Run runs a worker for each domain, and starts each again whenever it
// ends (Supervisor.Run), until ctx is done; then it stops them and
// returns nil. It returns at once an error of a start that cannot succeed
// on any later try (a refused Identity).
func (m *Monitor) Run(ctx context.Context) error {
	m.mu.Lock()
	m.ctx = ctx
	for _, name := range slices.Sorted(maps.Keys(m.workers)) {
		m.start(m.workers[name])
	}
	m.mu.Unlock()
	var err error
	select {
	case <-ctx.Done():
	case err = <-m.fatal:
	}
	m.mu.Lock()
	workers := slices.Collect(maps.Values(m.workers))
	m.mu.Unlock()
	for _, w := range workers {
		if w.cancel != nil {
			w.cancel()
		}
	}
	m.runs.Wait()
	return err
}

// Close gives back the identity of each domain's worker
// (MonitorOptions.Identities). Call it once Run has returned, or when Run
// never ran; the monitor runs no worker after it.
func (m *Monitor) Close() {
	m.mu.Lock()
	workers := slices.Collect(maps.Values(m.workers))
	m.mu.Unlock()
	for _, w := range workers {
		w.release()
	}
}

// serve serves a worker's message through the request table
// (requests.go): the Supervisor has checked its phase; a breach of its
// budget is returned.
func (w *domainWorker) serve(msg Message) error {
	req := requests[msg.msgType()]
	if req.serve == nil {
		return fmt.Errorf("a %T is not served here", msg)
	}
	return req.serve(w, msg)
}

// ended takes the end of w's worker: what it asked for is forgotten, the
// deliveries waiting for it fail, and its domain's mounts are stale
// until the next one reports them.
func (w *domainWorker) ended(why error) {
	w.mu.Lock()
	clear(w.asked)
	for seq, answer := range w.posts {
		if answer != nil {
			answer <- fmt.Sprintf("the worker that delivers it ended before it answered (%v)", why)
		}
		delete(w.posts, seq)
	}
	w.mu.Unlock()
	w.m.remote.WorkerEnded(w.domain.Name, why)
}

// written takes a message once it is written to w's worker: a
// credential's file may be asked for again.
func (w *domainWorker) written(msg Message) {
	if c, ok := msg.(*Credential); ok {
		w.mu.Lock()
		delete(w.asked, c.Name)
		w.mu.Unlock()
	}
}

// relay logs msg, a record of w's worker, through the monitor's handler
// (which escapes outside text): its attributes in a group of their own,
// "worker", so that none stands for one of the monitor's (time, level,
// msg), with from=worker and its domain; within RelayRate.
func (w *domainWorker) relay(msg *Log) {
	w.mu.Lock()
	if !w.relayed.Allow() {
		w.dropped++
		w.mu.Unlock()
		return
	}
	dropped := w.dropped
	w.dropped = 0
	w.mu.Unlock()
	log := w.super.Log
	if dropped > 0 {
		log.Warn("dropped log lines of the worker: it logs faster than the relay allows", "dropped", dropped,
			"rate_per_second", float64(RelayRate), "burst", RelayBurst)
	}
	attrs := make([]any, 0, len(msg.Attrs)/2)
	for i := 0; i+1 < len(msg.Attrs); i += 2 {
		attrs = append(attrs, slog.String(msg.Attrs[i], msg.Attrs[i+1]))
	}
	level := min(max(slog.Level(msg.Level), slog.LevelDebug), slog.LevelError)
	log.LogAttrs(context.Background(), level, msg.Message, slog.Group("worker", attrs...), slog.String("from", "worker"))
}

// postGrace is how long the monitor waits for a worker's answer to a
// webhook beyond the webhook's own timeout.
const postGrace = 5 * time.Second

// PostWebhook implements notify.WebhookPoster: the worker of the
// webhook's mount's domain delivers it (Post), so that the response is
// read by an unprivileged process, never by root, and the headers (a
// credential, maybe) reach that worker alone. It returns the worker's
// error for the delivery, or why there was none: no worker serves the
// mount (it is being started again), the webhook is over the protocol's
// bounds, the worker ended, or no answer came within w.Timeout and
// postGrace.
func (m *Monitor) PostWebhook(ctx context.Context, wh notify.Webhook) error {
	post := &Post{URL: wh.URL, Target: wh.Target, Header: wh.Header, Body: wh.Body, Timeout: wh.Timeout}
	if err := Fits(post); err != nil {
		return fmt.Errorf("webhook %s: %w", wh.Target, err)
	}
	m.mu.Lock()
	w := m.workers[m.domainOf[wh.Mount]]
	m.mu.Unlock()
	if w == nil {
		return fmt.Errorf("webhook %s: no worker serves mount %q", wh.Target, wh.Mount)
	}
	answer := make(chan string, 1)
	w.mu.Lock()
	w.postSeq++
	post.Seq = w.postSeq
	w.posts[post.Seq] = answer
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		if _, ok := w.posts[post.Seq]; ok {
			// Its answer may still come: it is taken, not waited for.
			w.posts[post.Seq] = nil
		}
		w.mu.Unlock()
	}()
	if !w.super.Send(post) {
		w.mu.Lock()
		delete(w.posts, post.Seq)
		w.mu.Unlock()
		return fmt.Errorf("webhook %s: the worker, which delivers it, is not running", wh.Target)
	}
	ctx, cancel := context.WithTimeout(ctx, wh.Timeout+postGrace)
	defer cancel()
	select {
	case e := <-answer:
		if e != "" {
			return errors.New(e)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("webhook %s: no answer from the worker, which delivers it: %w", wh.Target, ctx.Err())
	}
}

// DomainWorker is one trust domain's worker, for /status and metrics.
type DomainWorker struct {
	Domain Domain
	// Policy is the policy it is confined to.
	Policy Policy
	// Supervisor runs it: its State, ObserveWorker.
	Supervisor *Supervisor
}

// Workers returns the worker of each trust domain, by domain name.
func (m *Monitor) Workers() []DomainWorker {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]DomainWorker, 0, len(m.workers))
	for _, name := range slices.Sorted(maps.Keys(m.workers)) {
		w := m.workers[name]
		d := w.domain
		d.Mounts = w.mounts
		out = append(out, DomainWorker{Domain: d, Policy: *w.policy.Load(), Supervisor: w.super})
	}
	return out
}

// maxWorkerLine bounds a line of a worker's own output, in bytes; the
// rest of a longer line is logged as lines of its own.
const maxWorkerLine = 4096

// lineLog logs what it is written, one log line per line of text (at
// most maxWorkerLine bytes), through the monitor's escaping handler. It
// is safe for concurrent use.
type lineLog struct {
	log *slog.Logger
	mu  sync.Mutex
	buf []byte
}

// Write implements io.Writer.
func (l *lineLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range p {
		if c != '\n' && len(l.buf) < maxWorkerLine {
			l.buf = append(l.buf, c)
			continue
		}
		l.log.Warn("worker output", "line", string(l.buf))
		l.buf = l.buf[:0]
		if c != '\n' {
			l.buf = append(l.buf, c)
		}
	}
	return len(p), nil
}
