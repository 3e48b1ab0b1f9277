package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/time/rate"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/notify"
	"github.com/kvmount/kvmount/privsep"
)

// WorkerUser is the user the worker runs as, which the packages create
// (sysusers.d). Where it does not exist, the worker runs as a user id of
// systemd's dynamic range that no user or group holds (DynamicUser=).
const WorkerUser = "kvmount"

// Dynamic user ids, as systemd allocates them for DynamicUser= (systemd's
// "UID/GID Ranges": 61184–65519).
const (
	dynamicFirst = 61184
	dynamicLast  = 65519
)

// workerUserName returns the worker's user: name, or WorkerUser for "".
func workerUserName(name string) string {
	if name == "" {
		return WorkerUser
	}
	return name
}

// workerIdentity returns the worker's user and group: name's, else the
// first id of the dynamic range that neither a user nor a group holds and
// no running process has as a user or group id — another process of the
// worker's uid could read its memory or signal it.
func workerIdentity(name string) (privsep.Identity, error) {
	if u, err := user.Lookup(name); err == nil {
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		if uid == 0 || gid == 0 {
			return privsep.Identity{}, fmt.Errorf("the worker's user %s is root, or in root's group", name)
		}
		return privsep.Identity{UID: uid, GID: gid}, nil
	}
	running := runningIDs()
	for id := dynamicFirst; id <= dynamicLast; id++ {
		s := strconv.Itoa(id)
		if running[id] {
			continue
		}
		if _, err := user.LookupId(s); err == nil {
			continue
		}
		if _, err := user.LookupGroupId(s); err == nil {
			continue
		}
		return privsep.Identity{UID: id, GID: id}, nil
	}
	return privsep.Identity{}, fmt.Errorf("no user %s, and no free id in %d–%d for the worker", name, dynamicFirst, dynamicLast)
}

// workerCommand returns the worker's command: this very program
// (/proc/self/exe, whatever replaced its file since), with WorkerEnv set,
// in /, in a process group of its own (a terminal's signals are the
// monitor's to pass on), with an environment of its own.
func (m *monitor) workerCommand() *exec.Cmd {
	cmd := exec.Command("/proc/self/exe")
	cmd.Args = []string{"kvmount-worker"}
	cmd.Dir = "/"
	cmd.Env = []string{WorkerEnv + "=" + m.mode, "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
	for _, name := range []string{"GORACE", "GOMAXPROCS"} {
		if v, ok := os.LookupEnv(name); ok {
			cmd.Env = append(cmd.Env, name+"="+v)
		}
	}
	// What the worker writes outside the protocol (a runtime's panic) is
	// logged a line at a time, escaped, never passed on raw.
	out := &lineLog{log: m.log}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd
}

// monitor is the privileged half's link to its worker: the supervisor,
// the desired state the worker's reports build, and the credential files
// the worker may ask it for.
type monitor struct {
	log *slog.Logger
	// policy is the worker's confinement policy of the running
	// configuration, for /status.
	policy  atomic.Pointer[privsep.Policy]
	super   *privsep.Supervisor
	remote  *privsep.Remote
	rereads atomic.Pointer[[]string]
	// offered is what the kernel lets the worker confine itself with.
	offered privsep.Confinement
	// mode is the worker's WorkerEnv value (Options.workerMode).
	mode string

	mu sync.Mutex
	// postSeq numbers the webhooks handed to the worker; posts are those
	// waiting for its answer, by Seq.
	postSeq uint32
	posts   map[uint32]chan string
	// asked are the credential files the worker asked for whose answer is
	// not written yet.
	asked map[string]bool
	// relayed paces the worker's log lines; dropped counts those it held
	// back since the last relayed one.
	relayed *rate.Limiter
	dropped int
}

// newMonitor returns the monitor of cfg, whose files rec read, with the
// worker opts say (Options.WorkerUser); the worker starts when its
// supervisor runs.
func newMonitor(log *slog.Logger, cfg *config.Config, rec *config.Recorder, opts Options) (*monitor, error) {
	id, err := workerIdentity(workerUserName(opts.WorkerUser))
	if err != nil {
		return nil, err
	}
	m := &monitor{log: log, remote: privsep.NewRemote(), offered: privsep.Offered(), mode: opts.workerMode, posts: map[uint32]chan string{},
		asked: map[string]bool{}, relayed: rate.NewLimiter(relayRate, relayBurst)}
	if m.mode == "" {
		m.mode = "worker"
	}
	m.super = &privsep.Supervisor{
		Command: m.workerCommand, Identity: id, Log: log,
		OnPayload: m.remote.HandlePayload, OnMessage: m.handle, OnIdle: m.remote.Idle, OnEnd: m.ended,
		Budget: m.remote.Budget, OnWritten: m.written,
	}
	if err := m.remote.SetMounts(cfg.Mounts); err != nil {
		return nil, err
	}
	m.remote.SetMaxTotal(cfg.MaxTotalSize)
	m.setRereads(cfg)
	policy, _ := privsep.PolicyFor(cfg)
	m.policy.Store(&policy)
	if err := m.super.Configure(context.Background(), configuration(cfg, rec), false); err != nil {
		return nil, err
	}
	return m, nil
}

// configuration returns what a worker is given to run cfg.
func configuration(cfg *config.Config, rec *config.Recorder) privsep.Configuration {
	inputs := rec.Recorded()
	inputs[cfg.Path] = cfg.Text
	return privsep.Configuration{Config: cfg.Path, Inputs: inputs, Mounts: privsep.Mounts(cfg.Mounts)}
}

// setRereads makes the credential files of cfgs' sources the ones the
// worker may ask for; any other is a breach of the protocol.
func (m *monitor) setRereads(cfgs ...*config.Config) {
	var names []string
	for _, cfg := range cfgs {
		for _, src := range cfg.Sources {
			if r, ok := src.Settings.(config.RereadFiles); ok {
				names = append(names, r.RereadFiles()...)
			}
		}
	}
	m.rereads.Store(&names)
}

// handle takes the worker's messages other than payloads: its log
// records, logged here; a credential file asked for, read here if the
// configuration names it so; reports, for the desired state.
func (m *monitor) handle(msg privsep.Message) {
	switch msg := msg.(type) {
	case *privsep.Log:
		m.relay(msg)
	case *privsep.Posted:
		m.mu.Lock()
		answer := m.posts[msg.Seq]
		delete(m.posts, msg.Seq)
		m.mu.Unlock()
		if answer != nil {
			answer <- msg.Err
		}
	case *privsep.Reread:
		m.mu.Lock()
		again := m.asked[msg.Name]
		m.asked[msg.Name] = true
		m.mu.Unlock()
		if again {
			// One request per file in flight, as OpenSSH's monitor takes
			// each request only in its turn.
			m.super.Breach(fmt.Errorf("the worker asked for %s again before the answer to its last request was sent", msg.Name))
			return
		}
		if !slices.Contains(*m.rereads.Load(), msg.Name) {
			m.super.Breach(fmt.Errorf("the worker asked for %s, which the configuration does not name", msg.Name))
			return
		}
		answer := &privsep.Credential{Name: msg.Name}
		if s, err := config.ReadSecretFile(msg.Name); err != nil {
			answer.Err = err.Error()
		} else {
			answer.Value = []byte(s.Reveal())
		}
		m.super.Send(answer)
	default:
		m.remote.HandleMessage(msg)
	}
}

// ended takes the end of a worker: what it asked for is forgotten, and
// the mounts are stale until the next one reports them.
func (m *monitor) ended(why error) {
	m.mu.Lock()
	clear(m.asked)
	m.mu.Unlock()
	m.remote.WorkerEnded(why)
}

// written takes a message once it is written to the worker: a
// credential's file may be asked for again.
func (m *monitor) written(msg privsep.Message) {
	if c, ok := msg.(*privsep.Credential); ok {
		m.mu.Lock()
		delete(m.asked, c.Name)
		m.mu.Unlock()
	}
}

// The worker's log lines are relayed at most relayRate a second after a
// burst of relayBurst: what passes is dropped and counted, and said in a
// line of the monitor's own before the next relayed one, so that a
// worker cannot flood the journal — whose rate limit would then drop the
// monitor's own lines.
const (
	relayRate  = rate.Limit(50)
	relayBurst = 500
)

// relay logs msg, a record of the worker's, through the monitor's handler
// (which escapes outside text): its attributes in a group of their own,
// "worker", so that none stands for one of the monitor's (time, level,
// msg), and from=worker; within relayRate.
func (m *monitor) relay(msg *privsep.Log) {
	m.mu.Lock()
	if !m.relayed.Allow() {
		m.dropped++
		m.mu.Unlock()
		return
	}
	dropped := m.dropped
	m.dropped = 0
	m.mu.Unlock()
	if dropped > 0 {
		m.log.Warn("dropped log lines of the worker: it logs faster than the relay allows", "dropped", dropped,
			"rate_per_second", float64(relayRate), "burst", relayBurst)
	}
	attrs := make([]any, 0, len(msg.Attrs)/2)
	for i := 0; i+1 < len(msg.Attrs); i += 2 {
		attrs = append(attrs, slog.String(msg.Attrs[i], msg.Attrs[i+1]))
	}
	level := min(max(slog.Level(msg.Level), slog.LevelDebug), slog.LevelError)
	m.log.LogAttrs(context.Background(), level, msg.Message, slog.Group("worker", attrs...), slog.String("from", "worker"))
}

// postGrace is how long the monitor waits for the worker's answer to a
// webhook beyond the webhook's own timeout.
const postGrace = 5 * time.Second

// PostWebhook implements notify.WebhookPoster: the worker delivers w
// (privsep.Post), so that the webhook's response is read by an
// unprivileged process, never by root. It returns the worker's error for
// the delivery, or why there was none: no worker runs (it is being
// started again), w is over the protocol's bounds, or no answer came
// within w.Timeout and postGrace (the worker ended meanwhile).
func (m *monitor) PostWebhook(ctx context.Context, w notify.Webhook) error {
	post := &privsep.Post{URL: w.URL, Target: w.Target, Header: w.Header, Body: w.Body, Timeout: w.Timeout}
	if err := privsep.Fits(post); err != nil {
		return fmt.Errorf("webhook %s: %w", w.Target, err)
	}
	answer := make(chan string, 1)
	m.mu.Lock()
	m.postSeq++
	post.Seq = m.postSeq
	m.posts[post.Seq] = answer
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		delete(m.posts, post.Seq)
		m.mu.Unlock()
	}()
	if !m.super.Send(post) {
		return fmt.Errorf("webhook %s: the worker, which delivers it, is not running", w.Target)
	}
	ctx, cancel := context.WithTimeout(ctx, w.Timeout+postGrace)
	defer cancel()
	select {
	case e := <-answer:
		if e != "" {
			return errors.New(e)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("webhook %s: no answer from the worker, which delivers it: %w", w.Target, ctx.Err())
	}
}

// applyTimeout bounds the wait for the worker to apply a reloaded
// configuration.
const applyTimeout = 30 * time.Second

// reconfigure hands cfg to the worker — a new worker when cfg's stores
// need another Landlock policy than old's — and waits for it to apply it.
func (m *monitor) reconfigure(ctx context.Context, old, cfg *config.Config, rec *config.Recorder) error {
	oldPolicy, _ := privsep.PolicyFor(old)
	newPolicy, err := privsep.PolicyFor(cfg)
	if err != nil {
		return err
	}
	restart := !reflect.DeepEqual(oldPolicy, newPolicy)
	ctx, cancel := context.WithTimeout(ctx, applyTimeout)
	defer cancel()
	// Until the worker runs cfg, it may ask for the files of either.
	m.setRereads(old, cfg)
	if err := m.super.Configure(ctx, configuration(cfg, rec), restart); err != nil {
		m.setRereads(old)
		return err
	}
	m.setRereads(cfg)
	m.policy.Store(&newPolicy)
	m.remote.SetMaxTotal(cfg.MaxTotalSize)
	if restart {
		m.log.Info("the configuration reaches other stores: the worker starts again with them")
	}
	return nil
}

// run runs the worker until ctx is done.
func (m *monitor) run(ctx context.Context) error {
	err := m.super.Run(ctx)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// maxWorkerLine bounds a line of the worker's own output, in bytes; the
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

// runningIDs returns every user and group id (real, effective, saved,
// file system) of the processes /proc shows now.
func runningIDs() map[int]bool {
	ids := map[int]bool{}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return ids
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue // gone meanwhile
		}
		for _, line := range strings.Split(string(data), "\n") {
			if !strings.HasPrefix(line, "Uid:") && !strings.HasPrefix(line, "Gid:") {
				continue
			}
			for _, f := range strings.Fields(line)[1:] {
				if n, err := strconv.Atoi(f); err == nil {
					ids[n] = true
				}
			}
		}
	}
	return ids
}
