package daemon

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/etcdtest"
)

// fleetIdle is how long BenchmarkFleet watches the store and the daemons
// doing nothing.
const fleetIdle = 30 * time.Second

// BenchmarkFleet (make bench-fleet) measures fan-out: N kvmount daemons
// ($KVMOUNT_FLEET, default 100), separate process trees (monitor and
// worker) with separate state directories, each follow one shared prefix
// (into a tmpfs) and one of their own (on disk), against one in-process
// etcd ("etcd"), a 3-member etcd cluster of separate processes directly
// ("etcd-cluster") and through one etcd gRPC proxy ("etcd-proxy"), then
// one Consul agent whose limits.http_max_conns_per_client is raised (all
// the daemons connect from 127.0.0.1; their blocking queries wait 15 s),
// and the same as a client agent in front of 3 servers
// ("consul-cluster").
// It reports the time to project all N from cold; at rest, over
// fleetIdle, the store's CPU (also alone, before the daemons start), the
// requests it served per second and the daemons' memory (the sum of the
// PSS of every process; RSS and anonymous memory per daemon, both
// processes); the store's CPU per write while the daemons follow it;
// then, for each of b.N writes to the shared prefix, the time until each
// daemon switched its ..data: p50/p99/max over every daemon and write
// ("fanout-*"), and the p50/max over writes of the time until the last
// daemon had it ("all-*"); on the clusters, the leader killed and a write
// through the survivors — the time until they acknowledge it, from then
// until every daemon shows it, and the range reads and requests the
// survivors served (on Consul, the KV reads and requests the client
// agent served) ("leader-lost-*"), then the same with a follower killed
// ("follower-lost-*"); last the herd of a package
// upgrade — every daemon stopped, a write, every daemon started at once —
// the time until all show the write, the store's requests per second and
// CPU meanwhile, and on the cluster its range reads until then
// ("herd-ranges") and 10 s later ("herd-ranges-10s-after"). Each daemon
// has a private admin socket of its own. Run with -benchtime 20x;
// KVMOUNT_FLEET_KEEP=DIR keeps the daemons' directories and logs under
// DIR, and KVMOUNT_FLEET_NO_LOSS=1 kills no member (to measure the rest
// alone: in one early attempt the 3 Consul servers under 1,000 daemons,
// whose workers then crashed in herds, elected no new leader).
// KVMOUNT_FLEET_BIN names a kvmount binary to run instead of this tree's
// (another commit's, run after this one's with the same settings: a fleet
// of each at once would not fit the machine).
func BenchmarkFleet(b *testing.B) {
	n := 100
	if v := os.Getenv("KVMOUNT_FLEET"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			b.Fatalf("KVMOUNT_FLEET=%q: want a positive number of daemons", v)
		}
	}
	b.Run("etcd", func(b *testing.B) { benchFleet(b, n, fleetEtcd(b)) })
	b.Run("etcd-cluster", func(b *testing.B) { benchFleet(b, n, fleetEtcdCluster(b, false)) })
	b.Run("etcd-proxy", func(b *testing.B) { benchFleet(b, n, fleetEtcdCluster(b, true)) })
	b.Run("consul", func(b *testing.B) { benchFleet(b, n, fleetConsul(b, n)) })
	b.Run("consul-cluster", func(b *testing.B) { benchFleet(b, n, fleetConsulCluster(b, n)) })
}

// fleetEtcdCluster is a 3-member etcd cluster of separate processes
// (etcdtest.StartCluster, the etcd server binary), reached directly or —
// viaProxy — through one etcd gRPC proxy in front of it. Its CPU is the
// members' (the proxy's is not counted), its requests the gRPC messages
// the members received (grpc_server_msg_received_total), and ranges the
// range requests they served (etcd_mvcc_range_total).
func fleetEtcdCluster(b *testing.B, viaProxy bool) fleetStore {
	c := etcdtest.StartCluster(b, 3)
	cli := c.Client(b)
	endpoints := c.Endpoints()
	if viaProxy {
		endpoints = []string{"http://" + etcdtest.StartProxy(b, c, "--dial-keepalive-time", "10s").Addr}
	}
	quoted := make([]string, len(endpoints))
	for i, ep := range endpoints {
		quoted[i] = strconv.Quote(ep)
	}
	// metricOf sums the counter name over members (all when none).
	metricOf := func(name string, members ...*etcdtest.Member) float64 {
		if len(members) == 0 {
			members = c.Members
		}
		total := 0.0
		for _, m := range members {
			resp, err := http.Get(m.ClientURL + "/metrics")
			if err != nil {
				b.Fatal(err)
			}
			parser := expfmt.NewTextParser(model.UTF8Validation)
			families, err := parser.TextToMetricFamilies(resp.Body)
			resp.Body.Close()
			if err != nil {
				b.Fatalf("etcd metrics: %v", err)
			}
			for _, m := range families[name].GetMetric() {
				total += m.GetCounter().GetValue()
			}
		}
		return total
	}
	metric := func(name string) float64 { return metricOf(name) }
	// memberLost kills the leader (or a follower), runs during, and
	// returns the range reads and requests the two survivors served
	// meanwhile (a killed member's counters start again at 0); then
	// restarts the member and waits until the cluster takes a write
	// through it.
	memberLost := func(killLeader bool, during func()) (ranges, requests float64) {
		ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Timeout)
		defer cancel()
		st, err := cli.Status(ctx, c.Members[0].ClientURL)
		if err != nil {
			b.Fatal(err)
		}
		leader := c.ByID(b, cli, st.Leader)
		lost := leader
		if !killLeader {
			lost = c.Members[0]
			if lost == leader {
				lost = c.Members[1]
			}
		}
		var survivors []*etcdtest.Member
		for _, m := range c.Members {
			if m != lost {
				survivors = append(survivors, m)
			}
		}
		r0, q0 := metricOf("etcd_mvcc_range_total", survivors...), metricOf("grpc_server_msg_received_total", survivors...)
		lost.Kill()
		during()
		ranges = metricOf("etcd_mvcc_range_total", survivors...) - r0
		requests = metricOf("grpc_server_msg_received_total", survivors...) - q0
		lost.Restart(b)
		one := c.Client(b, lost)
		for deadline := time.Now().Add(etcdtest.Timeout); ; time.Sleep(100 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_, err := one.Put(ctx, "/etcdtest/ready", "1")
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("the restarted member never took a write: %v", err)
			}
		}
		return ranges, requests
	}
	return fleetStore{
		memberLost: memberLost,
		benchStore: benchStore{
			source:   fmt.Sprintf("type = \"etcd\"\nendpoints = [%s]\n", strings.Join(quoted, ", ")),
			endpoint: endpoints[0],
			prefix:   "/bench/",
			put: func(key, value string) error {
				ctx, cancel := context.WithTimeout(context.Background(), etcdtest.Timeout)
				defer cancel()
				_, err := cli.Put(ctx, key, value)
				return err
			},
			seed: func(kv []string) { etcdtest.Put(b, cli, kv...) },
		},
		cpu: func() time.Duration {
			var total time.Duration
			for _, m := range c.Members {
				total += processCPU(b, m.Pid())
			}
			return total
		},
		requests: func() float64 { return metric("grpc_server_msg_received_total") },
		ranges:   func() float64 { return metric("etcd_mvcc_range_total") },
	}
}

// fleetStore is a store with the means to watch it at rest.
type fleetStore struct {
	benchStore
	// cpu returns the CPU time the store has used so far.
	cpu func() time.Duration
	// requests returns how many requests the store has served so far,
	// and ranges how many range reads (nil where it cannot tell).
	requests func() float64
	ranges   func() float64
	// memberLost, where the store is a cluster, kills its leader (or,
	// killLeader unset, a follower), runs during, restarts the member, and
	// returns the range reads and requests the survivors served during
	// it.
	memberLost func(killLeader bool, during func()) (ranges, requests float64)
}

// fleetEtcd is an in-process etcd: its CPU is this process's (idle but
// for it while the daemons rest), its requests the gRPC messages it
// received (a unary call is one; a watch stream's create, cancel and
// progress requests one each).
func fleetEtcd(b *testing.B) fleetStore {
	return fleetStore{
		benchStore: etcdStore(b),
		cpu: func() time.Duration {
			var ru unix.Rusage
			if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
				b.Fatal(err)
			}
			return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		},
		requests: func() float64 {
			families, err := prometheus.DefaultGatherer.Gather()
			if err != nil {
				b.Fatal(err)
			}
			total := 0.0
			for _, f := range families {
				if f.GetName() == "grpc_server_msg_received_total" {
					for _, m := range f.GetMetric() {
						total += m.GetCounter().GetValue()
					}
				}
			}
			return total
		},
	}
}

// fleetConsul is a Consul agent that accepts ten connections per daemon
// and keeps Prometheus metrics: its requests are the count of its
// consul_api_http summary, less the metrics requests themselves.
func fleetConsul(b *testing.B, n int) fleetStore {
	agent := consultest.Start(b,
		"-hcl", fmt.Sprintf("limits { http_max_conns_per_client = %d }", 10*n+200),
		"-hcl", `telemetry { prometheus_retention_time = "1h" disable_hostname = true }`)
	store := consulStoreOf(b, agent)
	// A blocking query returns at least once per wait, changed or not:
	// 15 s (instead of 5 min) so that a rest of fleetIdle sees each
	// daemon's query return about twice.
	store.source += "wait = \"15s\"\n"
	return fleetStore{
		benchStore: store,
		cpu: func() time.Duration {
			return processCPU(b, agent.PID())
		},
		requests: consulRequests(b, agent.URL()),
	}
}

// fleetConsulCluster is Consul as production runs it: 3 servers and a
// client agent the daemons talk to (consultest.StartCluster), every
// daemon's blocking queries waiting 15 s, as fleetConsul's. Its CPU is
// the four agents', its requests the HTTP requests the client agent
// served.
func fleetConsulCluster(b *testing.B, n int) fleetStore {
	c := consultest.StartClusterWith(b, 3,
		"-hcl", fmt.Sprintf("limits { http_max_conns_per_client = %d }", 10*n+200),
		"-hcl", `telemetry { prometheus_retention_time = "1h" disable_hostname = true }`)
	store := consulStoreAt(b, c.Client.Addr(), c.Client.APIClient())
	store.source += "wait = \"15s\"\n"
	url := "http://" + c.Client.Addr()
	requests := consulRequests(b, url)
	// memberLost kills the leading server (or another), runs during, and
	// returns the KV reads (blocking queries and the reads after them)
	// and all the requests the client agent served meanwhile; then starts
	// the server again and waits until the cluster takes a write.
	memberLost := func(killLeader bool, during func()) (ranges, served float64) {
		leader := c.WaitLeader()
		lost := leader
		if !killLeader {
			for _, s := range c.Servers {
				if s != leader {
					lost = s
					break
				}
			}
		}
		r0, q0 := consulKVReads(b, url), requests()
		lost.Kill()
		during()
		ranges, served = consulKVReads(b, url)-r0, requests()-q0
		lost.Start()
		c.WaitLeader()
		return ranges, served
	}
	return fleetStore{
		memberLost: memberLost,
		benchStore: store,
		cpu: func() time.Duration {
			total := processCPU(b, c.Client.PID())
			for _, s := range c.Servers {
				total += processCPU(b, s.PID())
			}
			return total
		},
		requests: requests,
	}
}

// consulRequests returns a count of the HTTP requests the agent at url
// served (consul_api_http), less the requests for the count itself.
func consulRequests(b *testing.B, url string) func() float64 {
	asked := 0.0
	return func() float64 {
		total := consulHTTP(b, url, func(method, path string) bool { return true })
		asked++
		return total - (asked - 1)
	}
}

// consulKVReads returns how many KV reads the agent at url has served:
// its consul_api_http count of GETs of v1/kv (blocking queries, and the
// reads that confirm them).
func consulKVReads(b *testing.B, url string) float64 {
	return consulHTTP(b, url, func(method, path string) bool { return method == "GET" && path == "v1_kv_" })
}

// consulHTTP returns the count of the agent's consul_api_http summary
// over the series whose method and path labels pass keep.
func consulHTTP(b *testing.B, url string, keep func(method, path string) bool) float64 {
	resp, err := http.Get(url + "/v1/agent/metrics?format=prometheus")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		b.Fatalf("agent metrics: %v", err)
	}
	f := families["consul_api_http"]
	if f == nil {
		b.Fatalf("agent metrics lack consul_api_http")
	}
	total := 0.0
	for _, m := range f.GetMetric() {
		var method, path string
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "method":
				method = l.GetValue()
			case "path":
				path = l.GetValue()
			}
		}
		if keep(method, path) {
			total += float64(m.GetSummary().GetSampleCount())
		}
	}
	return total
}

// processCPU returns the user and system CPU time of process pid, from
// /proc/<pid>/stat (fields 14 and 15, in clock ticks of 1/100 s).
func processCPU(b *testing.B, pid int) time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// The command name (field 2) may hold spaces; fields count from after it.
	fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
	utime, _ := strconv.ParseInt(fields[11], 10, 64)
	stime, _ := strconv.ParseInt(fields[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// processMemory returns fields of /proc/<pid>/smaps_rollup in bytes, such
// as "Rss" (resident set size, counting pages shared with other processes
// in full), "Pss" (proportional set size: a shared page divided among its
// sharers, so that the sum over processes is the memory they use) and
// "Anonymous" (the process's own heap and stacks).
func processMemory(b *testing.B, pid int) map[string]int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		b.Fatal(err)
	}
	out := map[string]int64{}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[2] == "kB" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			out[strings.TrimSuffix(f[0], ":")] = kb << 10
		}
	}
	return out
}

func benchFleet(b *testing.B, n int, store fleetStore) {
	shared := store.prefix + "shared/"
	kv := []string{shared + "key", "0"}
	for i := range n {
		kv = append(kv, fmt.Sprintf("%svm%04d/key", store.prefix, i), fmt.Sprint(i))
	}
	for i := 0; i < len(kv); i += 128 {
		store.seed(kv[i:min(i+128, len(kv))])
	}
	bin := os.Getenv("KVMOUNT_FLEET_BIN")
	if bin == "" {
		bin = buildKvmount(b)
	}
	base := b.TempDir()
	if keep := os.Getenv("KVMOUNT_FLEET_KEEP"); keep != "" {
		// The daemons' directories and logs kept after the run, to read.
		base = filepath.Join(keep, strings.ReplaceAll(b.Name(), "/", "_"))
		if err := os.MkdirAll(base, 0o700); err != nil {
			b.Fatal(err)
		}
	}
	// The store alone at rest, for comparison.
	cpu0, t0 := store.cpu(), time.Now()
	time.Sleep(fleetIdle)
	baseCPU, baseIdle := store.cpu()-cpu0, time.Since(t0)

	sharedDir := func(i int) string { return filepath.Join(base, fmt.Sprintf("vm%04d", i), "shared") }
	ownDir := func(i int) string { return filepath.Join(base, fmt.Sprintf("vm%04d", i), "own") }
	pids := make([]int, n)
	var cmds []*exec.Cmd
	// Each daemon logs to a file of its own (appended to across its
	// restarts); a daemon that fails to show a write is explained by
	// whether it runs and the end of its log.
	logPath := func(i int) string { return filepath.Join(base, fmt.Sprintf("vm%04d.log", i)) }
	var logs []*os.File
	b.Cleanup(func() {
		for _, f := range logs {
			f.Close()
		}
	})
	daemonLog := func(i int) *os.File {
		f, err := os.OpenFile(logPath(i), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			b.Fatal(err)
		}
		logs = append(logs, f)
		return f
	}
	explain := func(i int) string {
		state := "running"
		if cmds[i].ProcessState != nil || unix.Kill(cmds[i].Process.Pid, 0) != nil {
			state = "not running"
		}
		data, _ := os.ReadFile(logPath(i))
		lines := strings.Split(strings.TrimSpace(string(data)), "\n")
		return fmt.Sprintf("pid %d %s; its log ends:\n%s", cmds[i].Process.Pid, state, strings.Join(lines[max(len(lines)-8, 0):], "\n"))
	}
	b.Cleanup(func() {
		// All at once: one after the other, a hundred clean stops add up.
		for _, cmd := range cmds {
			_ = cmd.Process.Signal(syscall.SIGTERM)
		}
		for _, cmd := range cmds {
			_ = cmd.Wait()
		}
	})
	start := time.Now()
	for i := range n {
		// Each daemon has its own private admin socket, as on its own
		// VM (in one /run they would contend for one).
		cfg := fmt.Sprintf(`state_dir = %q
[admin]
address = ""
socket = %q
[sources.main]
%s
[[mount]]
name = "shared"
dir = %q
source = "main"
prefix = %q
medium = "tmpfs"

[[mount]]
name = "own"
dir = %q
source = "main"
prefix = "%svm%04d/"
`, filepath.Join(base, fmt.Sprintf("vm%04d", i), "state"), filepath.Join(base, fmt.Sprintf("vm%04d.sock", i)), store.source, sharedDir(i), shared, ownDir(i), store.prefix, i)
		configPath := filepath.Join(base, fmt.Sprintf("vm%04d.toml", i))
		if err := os.WriteFile(configPath, []byte(cfg), 0o644); err != nil {
			b.Fatal(err)
		}
		dir := sharedDir(i)
		b.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
		cmd := exec.Command(bin, "run", "-config", configPath)
		cmd.Stderr = daemonLog(i)
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		pids[i] = cmd.Process.Pid
		cmds = append(cmds, cmd)
	}
	waitProjected(b, n, 5*waitTimeout, "daemons projected both mounts", func(i int) bool {
		_, err1 := os.Lstat(filepath.Join(sharedDir(i), "key"))
		_, err2 := os.Lstat(filepath.Join(ownDir(i), "key"))
		return err1 == nil && err2 == nil
	}, explain)
	coldStart := time.Since(start)

	// At rest: after the daemons have settled (and returned their
	// start-up garbage), watch the store and the daemons do nothing.
	time.Sleep(5 * time.Second)
	cpu0, t0 = store.cpu(), time.Now()
	req0 := store.requests()
	time.Sleep(fleetIdle)
	cpu1, req1, idle := store.cpu(), store.requests(), time.Since(t0)
	// Each daemon is a process tree: the monitor and its worker.
	var rss, pss, anon int64
	for _, pid := range pids {
		for _, p := range append([]int{pid}, childPIDs(b, pid)...) {
			m := processMemory(b, p)
			rss, pss, anon = rss+m["Rss"], pss+m["Pss"], anon+m["Anonymous"]
		}
	}

	w := watchFleet(b, n, sharedDir)
	var each, all []time.Duration
	cpuW := store.cpu()
	b.ResetTimer()
	for i := range b.N {
		t0 := time.Now()
		if err := store.put(shared+"key", fmt.Sprintf("update %d", i)); err != nil {
			b.Fatal(err)
		}
		lat := w.collect(b, t0)
		each = append(each, lat...)
		all = append(all, slices.Max(lat))
	}
	b.StopTimer()
	cpuW = store.cpu() - cpuW

	// The herds of a lost member — the leader, then a follower —: the
	// member killed, a write through the others; the time until the store
	// acknowledges it, from then until every daemon shows it, and the
	// range reads (re-reads) and requests the survivors served meanwhile,
	// against resumed watches, which read nothing.
	for _, lost := range []struct {
		name       string
		killLeader bool
	}{{"leader-lost", true}, {"follower-lost", false}} {
		if store.memberLost == nil || os.Getenv("KVMOUNT_FLEET_NO_LOSS") != "" {
			break
		}
		value := "after the " + lost.name
		var acked, took time.Duration
		ranges, reqs := store.memberLost(lost.killLeader, func() {
			t0 := time.Now()
			// The first puts may time out while the survivors elect a
			// leader.
			for deadline := time.Now().Add(waitTimeout); ; time.Sleep(100 * time.Millisecond) {
				err := store.put(shared+"key", value)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					b.Fatal(err)
				}
			}
			acked = time.Since(t0)
			t0 = time.Now()
			waitProjected(b, n, 5*waitTimeout, "daemons showed the write after the "+lost.name, func(i int) bool {
				data, err := os.ReadFile(filepath.Join(sharedDir(i), "key"))
				return err == nil && string(data) == value
			}, explain)
			took = time.Since(t0)
			time.Sleep(5 * time.Second) // what follows at once: re-reads, re-watches
		})
		b.ReportMetric(acked.Seconds(), lost.name+"-write-acked-s")
		b.ReportMetric(took.Seconds(), lost.name+"-all-current-s")
		b.ReportMetric(ranges, lost.name+"-ranges")
		b.ReportMetric(reqs, lost.name+"-requests")
	}

	// The herd of a package upgrade: every daemon stopped, a write to the
	// shared prefix, every daemon started again at once; the time until
	// all show the write, and what the store served meanwhile.
	for _, cmd := range cmds {
		_ = cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, cmd := range cmds {
		_ = cmd.Wait()
	}
	if err := store.put(shared+"key", "after the herd"); err != nil {
		b.Fatal(err)
	}
	herdReq, herdRanges, herdCPU := store.requests(), 0.0, store.cpu()
	if store.ranges != nil {
		herdRanges = store.ranges()
	}
	herdRanges0 := herdRanges
	herdStart := time.Now()
	for i, cmd := range cmds {
		cmds[i] = exec.Command(bin, cmd.Args[1:]...)
		cmds[i].Stderr = daemonLog(i)
		if err := cmds[i].Start(); err != nil {
			b.Fatal(err)
		}
	}
	waitProjected(b, n, 5*waitTimeout, "daemons showed the write after restarting at once", func(i int) bool {
		data, err := os.ReadFile(filepath.Join(sharedDir(i), "key"))
		return err == nil && string(data) == "after the herd"
	}, explain)
	herd := time.Since(herdStart)
	herdReq, herdCPU = store.requests()-herdReq, store.cpu()-herdCPU
	if store.ranges != nil {
		herdRanges = store.ranges() - herdRanges
		b.ReportMetric(herdRanges, "herd-ranges")
		// Reads still under way when the last shared mount showed the
		// write (an own prefix read after it), and retries: 10 s on.
		time.Sleep(10 * time.Second)
		b.ReportMetric(store.ranges()-herdRanges0, "herd-ranges-10s-after")
	}
	b.ReportMetric(herd.Seconds(), "herd-all-current-s")
	b.ReportMetric(herdReq/herd.Seconds(), "herd-store-req/s")
	b.ReportMetric(float64(herdCPU)/float64(time.Millisecond), "herd-store-cpu-ms")

	report(b, "fanout", each)
	slices.Sort(all)
	b.ReportMetric(float64(all[len(all)/2])/float64(time.Millisecond), "all-p50-ms")
	b.ReportMetric(float64(all[len(all)-1])/float64(time.Millisecond), "all-max-ms")
	b.ReportMetric(coldStart.Seconds(), "cold-start-s")
	b.ReportMetric(100*float64(baseCPU)/float64(baseIdle), "store-alone-idle-cpu-%")
	b.ReportMetric(100*float64(cpu1-cpu0)/float64(idle), "store-idle-cpu-%")
	b.ReportMetric((req1-req0)/idle.Seconds(), "store-idle-req/s")
	b.ReportMetric(float64(cpuW)/float64(b.N)/float64(time.Millisecond), "store-cpu-ms/write")
	const mib = 1 << 20
	b.ReportMetric(float64(pss)/mib, "kvmount-total-pss-MiB")
	b.ReportMetric(float64(rss)/float64(n)/mib, "rss-per-daemon-MiB")
	b.ReportMetric(float64(anon)/float64(n)/mib, "anon-per-daemon-MiB")
}

// fleetWatcher learns of every daemon's switch of its shared mount's
// ..data through one inotify instance.
type fleetWatcher struct {
	fd     int
	daemon map[int32]int // watch descriptor → daemon
	n      int
}

func watchFleet(b *testing.B, n int, dir func(int) string) *fleetWatcher {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { unix.Close(fd) })
	w := &fleetWatcher{fd: fd, daemon: map[int32]int{}, n: n}
	for i := range n {
		wd, err := unix.InotifyAddWatch(fd, dir(i), unix.IN_MOVED_TO)
		if err != nil {
			b.Fatal(err)
		}
		w.daemon[int32(wd)] = i
	}
	return w
}

// collect returns, for each daemon, the time from t0 until its ..data was
// switched, waiting for all of them for at most waitTimeout.
func (w *fleetWatcher) collect(b *testing.B, t0 time.Time) []time.Duration {
	got := make([]time.Duration, w.n)
	seen := 0
	buf := make([]byte, 64<<10)
	deadline := time.Now().Add(waitTimeout)
	for seen < w.n {
		n, err := unix.Read(w.fd, buf)
		now := time.Since(t0)
		if err == nil && n > 0 {
			for off := 0; off+unix.SizeofInotifyEvent <= n; {
				ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
				name := strings.TrimRight(string(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+int(ev.Len)]), "\x00")
				off += unix.SizeofInotifyEvent + int(ev.Len)
				if i, ok := w.daemon[ev.Wd]; ok && name == "..data" && got[i] == 0 {
					got[i] = now
					seen++
				}
			}
			continue
		}
		left := time.Until(deadline)
		if left <= 0 {
			b.Fatalf("%d of %d daemons switched within %v", seen, w.n, waitTimeout)
		}
		fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}}
		if _, err := unix.Poll(fds, int(left.Milliseconds())+1); err != nil && err != unix.EINTR {
			b.Fatal(err)
		}
	}
	return got
}
