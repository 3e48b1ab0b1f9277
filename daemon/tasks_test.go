package daemon

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/privsep"
)

// exhaustMode is the WorkerEnv value, followed by ":" and a domain, that
// makes that domain's worker exhaustWorker; the other domains' workers
// are the daemon's own.
const exhaustMode = "exhaust"

// exhaustWorker is a compromised worker that takes every task its user
// may have: it hardens itself as the daemon's worker does (RLIMIT_NPROC
// privsep.MaxWorkerTasks), then starts processes that sleep until each
// start fails with EAGAIN, and goes on taking every task that is freed.
// A compromised worker would make threads (clone for a thread is
// allowed); it makes processes here because Go's runtime aborts when a
// thread cannot be made, and tasks of either kind count alike against
// the user's RLIMIT_NPROC. It logs "holding" with the count once the
// first start fails.
func exhaustWorker() {
	conn := privsep.WorkerConn()
	seq := awaitApply(conn)
	if err := privsep.Harden(privsep.WorkerFD); err != nil {
		os.Exit(1)
	}
	e := privsep.NewEncoder(conn)
	e.Encode(&privsep.Applied{Seq: seq})
	e.Flush()
	go io.Copy(io.Discard, conn)
	held, said := 0, false
	for {
		_, err := syscall.ForkExec("/bin/sleep", []string{"sleep", "600"}, &syscall.ProcAttr{})
		switch {
		case err == nil:
			held++
		case errors.Is(err, syscall.EAGAIN):
			if !said {
				e.Encode(&privsep.Log{Level: 0, Message: "holding", Attrs: []string{"tasks", strconv.Itoa(held)}})
				e.Flush()
				said = true
			}
			time.Sleep(5 * time.Millisecond)
		default:
			e.Encode(&privsep.Log{Level: 8, Message: "cannot start a process", Attrs: []string{"err", err.Error()}})
			e.Flush()
			os.Exit(1)
		}
	}
}

// TestWorkerTasksPerDomain: a compromised worker that takes every task
// its user may have (RLIMIT_NPROC) takes none of another trust domain's
// worker, which runs as a user of its own: killed, that worker starts
// again, once, and its mount follows the next write. Were the workers one
// user, the other domain's worker could make no thread, and would crash
// at each start (as 1,000 daemons sharing ids did: BENCHMARKS.md).
func TestWorkerTasksPerDomain(t *testing.T) {
	h := newHarness(t)
	h.sources = func() string {
		return fmt.Sprintf("[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n[sources.x]\ntype = \"etcd\"\nendpoints = [%q]\n", h.endpoint, h.endpoint)
	}
	h.put("/apps/app/app.conf", "v1")
	h.writeConfig(h.mount("app", "/apps/app/") + strings.Replace(h.mount("other", "/other/"), `source = "main"`, `source = "x"`, 1))
	h.workerMode = exhaustMode + ":x"
	h.start()
	dir := h.path("mnt", "app")
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	h.waitLog("msg=holding", "domain=x")
	workers := statusWorkers(t, h)
	if workers["main"] == nil || workers["x"] == nil || workers["main"].UID == workers["x"].UID {
		t.Fatalf("/status workers: %+v; want main and x, as two users", workers)
	}
	if err := syscall.Kill(workers["main"].PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	h.waitLog("the worker ended; starting it again", "domain=main", "signal: killed")
	h.put("/apps/app/app.conf", "v2")
	h.waitContent(dir, map[string]string{"app.conf": "v2"})
	// Started again once, and running since; the attacker runs on,
	// holding its tasks.
	time.Sleep(3 * time.Second)
	h.waitMetric(h.statusSocket(), `kvmount_worker_starts_total{domain="main"} 2`)
	h.waitMetric(h.statusSocket(), `kvmount_worker_starts_total{domain="x"} 1`)
	if n := h.logs.Count("the worker ended", "domain=main"); n != 1 {
		t.Errorf("the worker of main ended %d times; want once, by the test's kill:\n%s", n, h.logs)
	}
	h.put("/apps/app/app.conf", "v3")
	h.waitContent(dir, map[string]string{"app.conf": "v3"})
}
