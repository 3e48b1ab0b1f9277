package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"strings"
	"syscall"

	"github.com/kvmount/kvmount/config"
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
// first id of the dynamic range, from dynamicStart(the monitor's pid) on
// and around, that neither a user nor a group holds and no running
// process has as a user or group id — another process of the worker's
// uid could read its memory or signal it, and its threads count against
// the worker's RLIMIT_NPROC (privsep.MaxWorkerTasks).
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
	start := dynamicStart(os.Getpid())
	for i := range dynamicLast - dynamicFirst + 1 {
		id := dynamicFirst + (start-dynamicFirst+i)%(dynamicLast-dynamicFirst+1)
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

// dynamicStart returns where the search for a free dynamic id begins for
// the monitor of process pid: a place of its own in the range, so that
// monitors that start at once — a package upgrade on a host of several
// instances, a thousand on one test machine — do not all see the same
// first id free and take it together (the check and the worker's start
// are not one step). Sharing a uid, their workers' threads would count
// against one RLIMIT_NPROC: 1,000 daemons restarted at once on one
// machine lost workers to pthread_create's EAGAIN.
func dynamicStart(pid int) int {
	return dynamicFirst + pid%(dynamicLast-dynamicFirst+1)
}

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
	for _, name := range []string{"GORACE", "GOMAXPROCS"} {
		if v, ok := os.LookupEnv(name); ok {
			cmd.Env = append(cmd.Env, name+"="+v)
		}
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd
}

// monitor is the privileged half's link to its workers, one per trust
// domain (privsep.Monitor), and what the kernel lets them confine
// themselves with.
type monitor struct {
	*privsep.Monitor
	identity privsep.Identity
	offered  privsep.Confinement
}

// newMonitor returns the monitor of cfg, whose files rec read, with the
// workers opts say (Options.WorkerUser); they start when it runs.
func newMonitor(log *slog.Logger, cfg *config.Config, rec *config.Recorder, opts Options) (*monitor, error) {
	id, err := workerIdentity(workerUserName(opts.WorkerUser))
	if err != nil {
		return nil, err
	}
	mode := opts.workerMode
	if mode == "" {
		mode = "worker"
	}
	m := &monitor{identity: id, offered: privsep.Offered(), Monitor: privsep.NewMonitor(privsep.MonitorOptions{
		Log: log, Identity: id, Kinds: opts.Registry.Decoders(),
		Command: func(domain string) *exec.Cmd { return workerCommand(mode, domain) },
	})}
	if err := m.Remote().SetMounts(cfg.Mounts); err != nil {
		return nil, err
	}
	if err := m.Configure(context.Background(), cfg, inputs(cfg, rec)); err != nil {
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
