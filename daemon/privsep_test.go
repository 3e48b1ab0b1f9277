package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/privsep"
	"github.com/kvmount/kvmount/reconcile"
)

// TestWorkerHoldsNoPrivilege is issue 28's process tree: the daemon's
// worker, as the kernel shows it in /proc/PID/status, is not root, holds
// no capability in any set, has no_new_privs and a seccomp filter, and
// says it is confined; the mount is projected through it; killing it
// keeps the mount's content, and a new worker follows the next change.
func TestWorkerHoldsNoPrivilege(t *testing.T) {
	h := newHarness(t)
	h.put("/apps/app/app.conf", "v1")
	h.writeConfig(h.mount("app", "/apps/app/"))
	h.start()
	dir := h.path("mnt", "app")
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	h.waitLog("worker confined", "landlock_abi=", "seccomp=true", "from=worker")
	pid := workerPID(t, h, 1)
	status, err := os.ReadFile("/proc/" + pid + "/status")
	if err != nil {
		t.Fatal(err)
	}
	fields := map[string]string{}
	for _, line := range strings.Split(string(status), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			fields[k] = strings.Join(strings.Fields(v), " ")
		}
	}
	if uid := strings.Fields(fields["Uid"]); len(uid) != 4 || slices.Contains(uid, "0") {
		t.Errorf("the worker's Uid: %q; want no id 0", fields["Uid"])
	}
	for k, v := range map[string]string{"CapEff": "0000000000000000", "CapPrm": "0000000000000000", "CapBnd": "0000000000000000",
		"CapInh": "0000000000000000", "CapAmb": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"} {
		if fields[k] != v {
			t.Errorf("the worker's %s: %q; want %q", k, fields[k], v)
		}
	}
	// /status and /metrics say the same, from the kernel's view.
	n, _ := strconv.Atoi(pid)
	w := workerStatus(t, h)
	if !w.Running || w.PID != n || w.UID == 0 || w.Starts != 1 || w.Refusals != 0 || !w.Seccomp || !w.NoNewPrivs ||
		w.Capabilities || w.LandlockABI < 4 || len(w.Warnings) != 0 {
		t.Errorf("/status worker: %+v; want the running worker %d, confined", w, n)
	}
	if len(w.InForce) != 3 || !strings.Contains(w.InForce[0], "seccomp: an allowlist") || !strings.Contains(w.InForce[1], "Landlock ABI") {
		t.Errorf("/status says not what is in force: %q", w.InForce)
	}
	if w.Domain != "main" || !slices.Equal(w.Sources, []string{"main"}) || !slices.Equal(w.Mounts, []string{"app"}) {
		t.Errorf("/status worker of domain %q, sources %v, mounts %v; want main's", w.Domain, w.Sources, w.Mounts)
	}
	h.waitMetric(h.statusSocket(), `kvmount_worker_up{domain="main"} 1`)
	for _, want := range []string{`kvmount_worker_starts_total{domain="main"} 1`, `kvmount_worker_refusals_total{domain="main"} 0`, `kvmount_worker_seccomp{domain="main"} 1`,
		`kvmount_worker_landlock_abi{domain="main"} ` + strconv.Itoa(w.LandlockABI)} {
		h.waitMetric(h.statusSocket(), want)
	}
	// A worker that dies: logged, the content kept, a new one started.
	if err := syscall.Kill(n, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	h.waitLog("the worker ended; starting it again", "signal: killed")
	h.waitContent(dir, map[string]string{"app.conf": "v1"})
	second := workerPID(t, h, 2)
	h.put("/apps/app/app.conf", "v2")
	h.waitContent(dir, map[string]string{"app.conf": "v2"})
	h.waitMetric(h.statusSocket(), `kvmount_worker_starts_total{domain="main"} 2`)
	if w := workerStatus(t, h); strconv.Itoa(w.PID) != second || !strings.Contains(w.LastEnd, "signal: killed") {
		t.Errorf("/status worker after the kill: %+v; want worker %s, and the last end", w, second)
	}
}

// workerStatus returns the entry of the only worker in the daemon's
// /status.
func workerStatus(t *testing.T, h *harness) admin.WorkerStatus {
	t.Helper()
	_, body := unixGet(t, h.statusSocket(), "/status")
	var st admin.Status
	if err := json.Unmarshal([]byte(body), &st); err != nil || len(st.Workers) != 1 {
		t.Fatalf("/status: %v, not one worker:\n%s", err, body)
	}
	return *st.Workers[0]
}

// workerPID returns the PID of the nth worker the daemon started, from
// its log, waiting for it for 30 s at most.
func workerPID(t *testing.T, h *harness, nth int) string {
	t.Helper()
	re := regexp.MustCompile(`msg="worker started" domain=\S+ pid=([0-9]+)`)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if m := re.FindAllStringSubmatch(h.logs.String(), -1); len(m) >= nth {
			return m[nth-1][1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no worker %d started within 30 s:\n%s", nth, h.logs)
		}
	}
}

// TestConfinementWarnings: what the worker runs without is said for each
// kernel kvmount may meet, and nothing on one that offers all.
func TestConfinementWarnings(t *testing.T) {
	for _, tc := range []struct {
		offered privsep.Confinement
		want    []string
	}{
		{privsep.Confinement{LandlockABI: 7, Seccomp: true}, nil},
		{privsep.Confinement{LandlockABI: 4, Seccomp: true}, nil},
		{privsep.Confinement{LandlockABI: 3, Seccomp: true}, []string{"Landlock ABI 3, before 4"}},
		{privsep.Confinement{Seccomp: true}, []string{"no Landlock"}},
		{privsep.Confinement{LandlockABI: 7}, []string{"no seccomp"}},
		{privsep.Confinement{}, []string{"no Landlock", "no seccomp"}},
	} {
		got := confinementWarnings(tc.offered)
		if len(got) != len(tc.want) {
			t.Errorf("%+v: %q; want %d warnings", tc.offered, got, len(tc.want))
			continue
		}
		for i, w := range tc.want {
			if !strings.Contains(got[i], w) {
				t.Errorf("%+v: %q; want %q", tc.offered, got[i], w)
			}
		}
	}
}

// TestWorkerProcs: the worker leaves one CPU of its GOMAXPROCS to the
// monitor, and keeps one for itself.
func TestWorkerProcs(t *testing.T) {
	for procs, want := range map[int]int{1: 1, 2: 1, 4: 3, 64: 63} {
		if got := workerProcs(procs); got != want {
			t.Errorf("workerProcs(%d) = %d; want %d", procs, got, want)
		}
	}
}

// TestWorkerEnvironment: a worker's environment is its mode, a PATH, and
// the Go runtime's settings the monitor was given (GOMEMLIMIT and GOGC set
// in the unit apply to every process of kvmount); nothing else of the
// monitor's environment reaches it.
func TestWorkerEnvironment(t *testing.T) {
	t.Setenv("GOMEMLIMIT", "64MiB")
	t.Setenv("GOGC", "50")
	t.Setenv("KVMOUNT_TEST_SECRET", "not for the worker")
	got := workerCommand("worker", "main").Env
	for _, want := range []string{WorkerEnv + "=worker", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "GOMEMLIMIT=64MiB", "GOGC=50"} {
		if !slices.Contains(got, want) {
			t.Errorf("the worker's environment %q lacks %q", got, want)
		}
	}
	for _, kv := range got {
		name, _, _ := strings.Cut(kv, "=")
		if name != WorkerEnv && name != "PATH" && !slices.Contains(workerRuntimeEnv, name) {
			t.Errorf("the worker's environment holds %q", kv)
		}
	}
}

// TestWorkerSaysWhatItCuts: lists over the protocol's bounds reach the
// monitor cut, with what was cut said in the last entry: sources waiting
// past 64 as a stale entry, stale entries past it as "and N more".
func TestWorkerSaysWhatItCuts(t *testing.T) {
	d := &reconcile.DesiredMount{}
	for i := range 70 {
		d.Waiting = append(d.Waiting, fmt.Sprintf("s%d", i))
		d.Stale = append(d.Stale, fmt.Errorf("source %q: unreachable", fmt.Sprintf("t%d", i)))
	}
	st := mountState("app", d)
	if len(st.Waiting) != privsep.MaxListLen || len(st.Stale) != privsep.MaxListLen {
		t.Fatalf("%d waiting, %d stale; want %d each", len(st.Waiting), len(st.Stale), privsep.MaxListLen)
	}
	// 70 stale and one for the 6 waiting left out: 63 kept, 8 more.
	if last := st.Stale[len(st.Stale)-1]; last != "and 8 more" {
		t.Errorf("last stale entry %q; want \"and 8 more\"", last)
	}
	d.Stale = nil
	if st := mountState("app", d); !slices.Equal(st.Stale, []string{"6 more sources have no snapshot yet (only 64 are named)"}) {
		t.Errorf("stale %q; want the 6 waiting sources left out counted", st.Stale)
	}

}

// socketOwner returns the uid that owns the TCP socket bound to addr
// (ip:port, IPv4), from /proc/net/tcp.
func socketOwner(t *testing.T, addr string) int {
	t.Helper()
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	ip := ap.Addr().As4()
	// The kernel prints the address as a native-endian (little-endian
	// here) 32-bit number, and the port big-endian, both in hex.
	want := fmt.Sprintf("%02X%02X%02X%02X:%04X", ip[3], ip[2], ip[1], ip[0], ap.Port())
	table, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(table), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 7 && f[1] == want {
			uid, _ := strconv.Atoi(f[7])
			return uid
		}
	}
	t.Fatalf("no socket %s (%s) in /proc/net/tcp", addr, want)
	return -1
}

// TestWebhookFromTheWorker: a webhook is delivered by the worker, not by
// root — the connection that reaches the webhook belongs to the worker's
// user — and an error response reaches the monitor's log and /status as
// the worker reported it, escaped.
func TestWebhookFromTheWorker(t *testing.T) {
	owners := make(chan int, 16)
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		owners <- socketOwner(t, r.RemoteAddr)
		if r.Header.Get("X-Token") != "t0k" || r.Header.Get("Content-Type") != "application/json" {
			t.Errorf("headers %v", r.Header)
		}
		if r.URL.Path == "/fail" {
			http.Error(w, "no\x1b[31m", http.StatusServiceUnavailable)
		}
	}))
	defer hook.Close()
	h := newHarness(t)
	h.put("/apps/app/app.conf", "v1")
	h.writeConfig(h.mount("app", "/apps/app/", "  [[mount.notify]]", fmt.Sprintf("  webhook = %q", hook.URL+"/ok"), "  headers = { X-Token = \"t0k\" }",
		"  [[mount.notify]]", fmt.Sprintf("  webhook = %q", hook.URL+"/fail"), "  headers = { X-Token = \"t0k\" }"))
	h.start()
	h.waitContent(h.path("mnt", "app"), map[string]string{"app.conf": "v1"})
	worker, _ := strconv.Atoi(workerPID(t, h, 1))
	w := workerStatus(t, h)
	for range 2 {
		select {
		case uid := <-owners:
			if uid == 0 || uid != w.UID {
				t.Errorf("the webhook's connection is uid %d's; want the worker's (pid %d, uid %d)", uid, worker, w.UID)
			}
		case <-time.After(waitTimeout):
			t.Fatal("no webhook")
		}
	}
	h.waitLog("503 Service Unavailable", `x1b[31m`)
	if strings.Contains(h.logs.String(), "no\x1b") {
		t.Error("the webhook's answer is logged raw")
	}
}

// TestWorkerUIDIsNobodyElses (issue 36, 9): the worker runs as a dynamic
// id that no user, no group and no running process holds — a process of
// the same uid could read its memory or signal it.
func TestWorkerUIDIsNobodyElses(t *testing.T) {
	roottest.Require(t)
	first, release := takeID(t, mustDynamicUsers(t, "kvmount-test-no-such-group"), "a")
	release()
	squatter := exec.Command("/bin/sleep", "30")
	squatter.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(first.UID), Gid: uint32(first.GID)}}
	if err := squatter.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { squatter.Process.Kill(); squatter.Wait() }()
	// A monitor of the same pid begins its search at the same place.
	next, release := takeID(t, mustDynamicUsers(t, "kvmount-test-no-such-group"), "a")
	defer release()
	if next.UID == first.UID || next.GID != next.UID {
		t.Errorf("the worker's id %+v is the running process's (%d), or its group not its own", next, first.UID)
	}
}

// TestDynamicUsersLocked: each domain's worker takes an id of its own,
// locked as systemd locks DynamicUser= ids (/run/systemd/dynamic-uid/UID,
// flock(2)ed): another monitor — another kvmount, or systemd — finds it
// held and takes another, and an id systemd holds is passed over; the
// id is unlocked and its file removed when given back. The workers' group
// is the one named where it exists, and root's group is refused.
func TestDynamicUsersLocked(t *testing.T) {
	roottest.Require(t)
	a, b := mustDynamicUsers(t, "kvmount-test-no-such-group"), mustDynamicUsers(t, "daemon")
	ida, releaseA := takeID(t, a, "a")
	lockFile := filepath.Join(dynamicLockDir, strconv.Itoa(ida.UID))
	idb, releaseB := takeID(t, b, "b")
	defer releaseB()
	if idb.UID == ida.UID {
		t.Fatalf("two monitors took id %d", ida.UID)
	}
	if g, err := user.LookupGroup("daemon"); err != nil || strconv.Itoa(idb.GID) != g.Gid || ida.GID != ida.UID {
		t.Errorf("groups %d and %d; want daemon's and a's own id", idb.GID, ida.GID)
	}
	// Held as systemd holds its ids.
	f, err := os.OpenFile(lockFile, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); !errors.Is(err, syscall.EWOULDBLOCK) {
		t.Errorf("flock of a held id's file: %v; want EWOULDBLOCK", err)
	}
	f.Close()
	if st, err := os.Stat(lockFile); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("%s: %v, %v; want a file of mode 0600", lockFile, st, err)
	}
	// The id b would take next, locked by another (systemd), is passed
	// over.
	taken := filepath.Join(dynamicLockDir, strconv.Itoa(b.next))
	held, err := os.OpenFile(taken, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { os.Remove(taken); held.Close() }()
	if err := syscall.Flock(int(held.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		t.Fatal(err)
	}
	idc, releaseC := takeID(t, b, "c")
	defer releaseC()
	if strconv.Itoa(idc.UID) == filepath.Base(taken) || idc.UID == ida.UID || idc.UID == idb.UID {
		t.Errorf("took %d, held elsewhere (%s, %d, %d)", idc.UID, filepath.Base(taken), ida.UID, idb.UID)
	}
	releaseA()
	if _, err := os.Stat(lockFile); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after the id was given back: %v; want it removed", lockFile, err)
	}
	if _, err := newDynamicUsers("root"); err == nil {
		t.Error("root's group taken for the workers")
	}
	// A lock directory another user could write is not used.
	open := filepath.Join(t.TempDir(), "dynamic-uid")
	if err := os.Mkdir(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	exposed := &dynamicUsers{group: -1, lockDir: open, next: dynamicFirst}
	if _, _, err := exposed.take("x"); !errors.Is(err, fsutil.ErrNotPrivate) {
		t.Errorf("take with a lock directory others can write: %v; want ErrNotPrivate", err)
	}
}

// mustDynamicUsers returns newDynamicUsers(group), failing the test on
// an error.
func mustDynamicUsers(t *testing.T, group string) *dynamicUsers {
	t.Helper()
	u, err := newDynamicUsers(group)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// takeID returns u.take(domain), failing the test on an error.
func takeID(t *testing.T, u *dynamicUsers, domain string) (privsep.Identity, func()) {
	t.Helper()
	id, release, err := u.take(domain)
	if err != nil {
		t.Fatal(err)
	}
	return id, release
}

// TestDynamicStartsSpread: monitors that start at once begin their
// search for a free dynamic id at places of their own (pids in a row, as
// a herd of restarts has them, and far apart), always within systemd's
// dynamic range — not all at its first id, which they would all see free
// and take together.
func TestDynamicStartsSpread(t *testing.T) {
	seen := map[int]bool{}
	for _, pid := range []int{1, 2, 3, 4000, 4001, 4336, 4337, 32767, 4194303} {
		id := dynamicStart(pid)
		if id < dynamicFirst || id > dynamicLast {
			t.Errorf("pid %d starts at %d, outside %d–%d", pid, id, dynamicFirst, dynamicLast)
		}
		seen[id] = true
	}
	if len(seen) < 8 {
		t.Errorf("9 pids start at %d distinct ids; want them spread", len(seen))
	}
}

// statusWorkers returns the workers of the daemon's /status, by domain.
func statusWorkers(t *testing.T, h *harness) map[string]*admin.WorkerStatus {
	t.Helper()
	_, body := unixGet(t, h.statusSocket(), "/status")
	var st admin.Status
	if err := json.Unmarshal([]byte(body), &st); err != nil {
		t.Fatalf("/status: %v\n%s", err, body)
	}
	out := map[string]*admin.WorkerStatus{}
	for _, w := range st.Workers {
		out[w.Domain] = w
	}
	return out
}

// TestWorkerPerTrustDomain is issue 36's tenth finding: two sources that
// no mount reads together run in two workers, one per trust domain.
// Killing one leaves the other running and its mount current, while its
// own mount goes stale and comes back with the next worker; a reload that
// adds a mount reading both joins them into one domain — its worker
// started, the two before stopped, every mount projected from it.
func TestWorkerPerTrustDomain(t *testing.T) {
	h := newHarness(t)
	h.sources = func() string {
		return fmt.Sprintf("[sources.a]\ntype = \"etcd\"\nendpoints = [%q]\n[sources.b]\ntype = \"etcd\"\nendpoints = [%q]\n", h.endpoint, h.endpoint)
	}
	mount := func(name, source, prefix string) string {
		return strings.Replace(h.mount(name, prefix), `source = "main"`, fmt.Sprintf("source = %q", source), 1)
	}
	ma, mb := h.path("mnt", "ma"), h.path("mnt", "mb")
	h.put("/a/x", "1", "/b/y", "2")
	h.writeConfig(mount("ma", "a", "/a/") + mount("mb", "b", "/b/"))
	h.start()
	h.waitContent(ma, map[string]string{"x": "1"})
	h.waitContent(mb, map[string]string{"y": "2"})
	workers := statusWorkers(t, h)
	if len(workers) != 2 || workers["a"] == nil || workers["b"] == nil ||
		!slices.Equal(workers["a"].Mounts, []string{"ma"}) || !slices.Equal(workers["b"].Mounts, []string{"mb"}) {
		t.Fatalf("/status workers: %+v; want a (ma) and b (mb)", workers)
	}
	a, b := workers["a"].PID, workers["b"].PID
	if a == 0 || b == 0 || a == b {
		t.Fatalf("worker pids %d and %d", a, b)
	}
	// Each as a user of its own, whose id is locked as long as its
	// domain is.
	uidA, uidB := workers["a"].UID, workers["b"].UID
	lockOf := func(uid int) string { return filepath.Join(dynamicLockDir, strconv.Itoa(uid)) }
	if uidA == uidB || uidA < dynamicFirst || uidB < dynamicFirst {
		t.Errorf("the workers of a and b run as uids %d and %d; want two dynamic ids", uidA, uidB)
	}
	for _, uid := range []int{uidA, uidB} {
		if _, err := os.Stat(lockOf(uid)); err != nil {
			t.Errorf("the lock of uid %d: %v", uid, err)
		}
	}

	if err := syscall.Kill(a, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	h.waitLog("the worker ended; starting it again", "domain=a")
	h.put("/b/y", "3")
	h.waitContent(mb, map[string]string{"y": "3"})
	h.waitMetric(h.statusSocket(), `kvmount_worker_starts_total{domain="a"} 2`)
	h.put("/a/x", "4")
	h.waitContent(ma, map[string]string{"x": "4"})
	if w := statusWorkers(t, h)["b"]; w == nil || w.PID != b || w.Starts != 1 {
		t.Errorf("the worker of b after a's was killed: %+v; want %d, started once", w, b)
	}
	a = statusWorkers(t, h)["a"].PID
	if uid := statusWorkers(t, h)["a"].UID; uid != uidA {
		t.Errorf("a's worker started again as uid %d; want its domain's, %d", uid, uidA)
	}

	h.writeConfig(mount("ma", "a", "/a/") + mount("mb", "b", "/b/") + fmt.Sprintf(`[[mount]]
name = "both"
dir = %q
  [[mount.projections]]
  source = "a"
  prefix = "/a/"
  [[mount.projections]]
  source = "b"
  prefix = "/b/"
`, h.path("mnt", "both")))
	h.sighup()
	h.waitContent(h.path("mnt", "both"), map[string]string{"x": "4", "y": "3"})
	h.waitLog("its worker stopped", "domain=a")
	h.waitLog("its worker stopped", "domain=b")
	workers = statusWorkers(t, h)
	if len(workers) != 1 || workers["a+b"] == nil || !slices.Equal(workers["a+b"].Mounts, []string{"both", "ma", "mb"}) ||
		!slices.Equal(workers["a+b"].Sources, []string{"a", "b"}) {
		t.Fatalf("/status workers after the reload: %+v; want a+b alone, with every mount", workers)
	}
	for _, pid := range []int{a, b} {
		if syscall.Kill(pid, 0) == nil {
			t.Errorf("the worker %d of a domain that is gone still runs", pid)
		}
	}
	// The users of the domains that are gone are given back; a+b has
	// its own.
	for _, uid := range []int{uidA, uidB} {
		if _, err := os.Stat(lockOf(uid)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the lock of uid %d, whose domain is gone: %v; want it removed", uid, err)
		}
	}
	if _, err := os.Stat(lockOf(workers["a+b"].UID)); err != nil {
		t.Errorf("the lock of a+b's uid %d: %v", workers["a+b"].UID, err)
	}
	h.put("/a/x", "5")
	h.waitContent(ma, map[string]string{"x": "5"})
	h.waitContent(h.path("mnt", "both"), map[string]string{"x": "5", "y": "3"})
}
