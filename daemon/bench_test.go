package daemon

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/embedetcd"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/reconcile"
)

// switchWatcher reports each switch of a mount's ..data, through inotify,
// so that a benchmark learns of a new version without polling.
type switchWatcher struct{ fd int }

func watchSwitches(b *testing.B, dir string) *switchWatcher {
	b.Helper()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_MOVED_TO); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { unix.Close(fd) })
	return &switchWatcher{fd: fd}
}

// wait blocks until ..data is renamed into place, for at most waitTimeout.
func (w *switchWatcher) wait(b *testing.B) {
	buf := make([]byte, 4096)
	for {
		n, err := unix.Read(w.fd, buf)
		if err == nil && n > 0 {
			return
		}
		fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}}
		ready, err := unix.Poll(fds, int(waitTimeout.Milliseconds()))
		if err != nil && err != unix.EINTR {
			b.Fatal(err)
		}
		if ready == 0 {
			b.Fatal("no switch of ..data within the timeout")
		}
	}
}

// benchStore is the store a latency benchmark writes to.
type benchStore struct {
	// source is the [sources.main] table reaching the store, and
	// endpoint its client URL.
	source   string
	endpoint string
	// prefix is where the benchmark's keys live.
	prefix string
	// port is the store's client port, for counting connections to it.
	port int
	// put writes one key.
	put func(key, value string) error
	// seed writes many keys.
	seed func(kv []string)
}

// etcdStore starts an in-process etcd with fsync on.
func etcdStore(b *testing.B) benchStore {
	srv, err := embedetcd.Start(filepath.Join(b.TempDir(), "etcd"), embedetcd.Options{Fsync: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(srv.Stop)
	cli, err := srv.Client()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cli.Close() })
	return benchStore{
		source:   fmt.Sprintf("type = \"etcd\"\nendpoints = [%q]\n", srv.Endpoint()),
		endpoint: srv.Endpoint(),
		prefix:   "/bench/",
		put: func(key, value string) error {
			_, err := cli.Put(context.Background(), key, value)
			return err
		},
		seed: func(kv []string) { etcdtest.Put(b, cli, kv...) },
	}
}

// consulStore starts a consul agent (-dev: in memory, so no fsync).
func consulStore(b *testing.B) benchStore {
	return consulStoreOf(b, consultest.Start(b))
}

// consulStoreOf is the store of a running agent.
func consulStoreOf(b *testing.B, agent *consultest.Agent) benchStore {
	return consulStoreAt(b, agent.Addr(), agent.Client())
}

// consulStoreAt is the store of the agent at addr ("host:port"), written
// through client.
func consulStoreAt(b *testing.B, addr string, client *api.Client) benchStore {
	return benchStore{
		source:   fmt.Sprintf("type = \"consul\"\naddress = %q\n", "http://"+addr),
		endpoint: "http://" + addr,
		port:     agentPort(addr),
		prefix:   "bench/",
		put: func(key, value string) error {
			_, err := client.KV().Put(&api.KVPair{Key: key, Value: []byte(value)}, nil)
			return err
		},
		seed: func(kv []string) { consultest.Txn(b, client, kv...) },
	}
}

// agentPort returns the port of a "host:port" address.
func agentPort(addr string) int {
	_, port, _ := strings.Cut(addr, ":")
	n, _ := strconv.Atoi(port)
	return n
}

// benchExtras are settings a benchmark adds to its daemon.
type benchExtras struct {
	// bin is the kvmount binary to run; "" builds this tree's.
	bin string
	// admin is [admin] address; "" turns the endpoint off.
	admin string
	// mount is appended to the [[mount]] table, such as notify entries.
	mount string
}

// benchDaemonWith runs the kvmount binary against store, projecting its
// prefix into a mount of medium after seeding it with keys, with the
// extra settings, and returns the mount directory once it holds them all.
func benchDaemonWith(b *testing.B, store benchStore, keys int, medium string, extra benchExtras) (dir string) {
	b.Helper()
	base := b.TempDir()
	for i := 0; i < keys; i += 100 {
		var kv []string
		for j := i; j < min(i+100, keys); j++ {
			kv = append(kv, fmt.Sprintf("%skey-%05d", store.prefix, j), fmt.Sprintf("value %d, padded to look like a small config line", j))
		}
		store.seed(kv)
	}
	dir = filepath.Join(base, "mnt")
	if medium == "tmpfs" {
		b.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	}
	bin := extra.bin
	if bin == "" {
		bin = buildKvmount(b)
	}
	admin := fmt.Sprintf("[admin]\naddress = %q\n", extra.admin)
	if extra.admin == "" && !knowsAdmin(b, bin) {
		admin = "" // a binary from before the admin endpoint
	}
	cfg := fmt.Sprintf("state_dir = %q\nresync_interval = \"1h\"\n%s[sources.main]\n%s[[mount]]\nname = \"bench\"\ndir = %q\nsource = \"main\"\nprefix = %q\nmedium = %q\n%s",
		filepath.Join(base, "state"), admin, store.source, dir, store.prefix, medium, extra.mount)
	configPath := filepath.Join(base, "kvmount.toml")
	if err := os.WriteFile(configPath, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}
	// kvmount runs as its own process, as in production: in this one, the
	// garbage collector would also scan the in-process etcd's heap.
	cmd := exec.Command(bin, "run", "-config", configPath)
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	deadline := time.Now().Add(waitTimeout)
	for {
		if got, _ := content(dir); len(got) >= keys {
			return dir
		}
		if time.Now().After(deadline) {
			b.Fatalf("mount never held %d keys", keys)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// TestMain removes the binary the benchmarks built and the directories
// they kept.
func TestMain(m *testing.M) {
	// The daemon starts this binary again as its worker, or as
	// TestHostileWorker's.
	if spec := os.Getenv(floorEnv); spec != "" {
		floorMain(spec)
	}
	switch mode := strings.SplitN(os.Getenv(WorkerEnv), ":", 3); mode[0] {
	case hostileMode:
		hostileWorker()
	case withholdingMode:
		withholdingWorker()
	case compromisedMode:
		compromisedWorker(mode[1], mode[2])
	case exhaustMode:
		if os.Args[len(os.Args)-1] == mode[1] {
			exhaustWorker()
		}
		os.Setenv(WorkerEnv, "worker")
	}
	MaybeWorker(testRegistry())
	code := m.Run()
	if binPath != "" {
		os.RemoveAll(filepath.Dir(binPath))
	}
	for _, dir := range kept {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// kept are the directories keepUntilExit made, removed by TestMain.
var kept []string

// keepUntilExit returns a new temporary directory that is removed only when
// the test binary exits, not when b ends (see BenchmarkScale100kKeys).
func keepUntilExit(b *testing.B) string {
	b.Helper()
	dir, err := os.MkdirTemp("", "kvmount-bench-kept")
	if err != nil {
		b.Fatal(err)
	}
	kept = append(kept, dir)
	return dir
}

// buildKvmount builds the kvmount binary once per benchmark run, as the
// packages build it (Makefile's package target: a static binary, cgo off,
// -trimpath): what operators run is what is measured. A cgo build maps
// the C library and its loader beside the binary and holds more of its
// own pages (BENCHMARKS.md, "The build the packages ship, measured").
func buildKvmount(b *testing.B) string {
	b.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kvmount-bench")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "kvmount")
		cmd := exec.Command("go", "build", "-trimpath", "-o", binPath, "../cmd/kvmount")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		out, err := cmd.CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		b.Fatal(buildErr)
	}
	return binPath
}

// measureUpdates puts b.N sequential updates of the keys key(i) and reports
// percentiles of two latencies: from the start of the put to the switch
// of ..data (end to end, etcd's commit and fsync included) and from the put's
// return to the switch (kvmount's own share).
func measureUpdates(b *testing.B, store benchStore, dir string, key func(i int) string) {
	w := watchSwitches(b, dir)
	total := make([]time.Duration, 0, b.N)
	after := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		k := key(i)
		value := fmt.Sprintf("update %d", i)
		start := time.Now()
		if err := store.put(store.prefix+k, value); err != nil {
			b.Fatal(err)
		}
		committed := time.Now()
		w.wait(b)
		end := time.Now()
		total = append(total, end.Sub(start))
		after = append(after, end.Sub(committed))
		b.StopTimer()
		if got, err := os.ReadFile(filepath.Join(dir, k)); err != nil || string(got) != value {
			b.Fatalf("after the switch %s = %q, %v; want %q", k, got, err, value)
		}
		b.StartTimer()
	}
	b.StopTimer()
	report(b, "e2e", total)
	report(b, "after-commit", after)
}

// report reports d's p50, p99 and maximum, in ms, as name's metrics, and
// returns the p50. It sorts d.
func report(b *testing.B, name string, d []time.Duration) (p50 float64) {
	slices.Sort(d)
	b.ReportMetric(percentile(d, 0.50), name+"-p50-ms")
	b.ReportMetric(percentile(d, 0.99), name+"-p99-ms")
	b.ReportMetric(float64(d[len(d)-1])/float64(time.Millisecond), name+"-max-ms")
	return percentile(d, 0.50)
}

// percentile returns the p quantile (0–1) of the sorted d, in ms.
func percentile(d []time.Duration, p float64) float64 {
	return float64(d[min(len(d)-1, int(p*float64(len(d))))]) / float64(time.Millisecond)
}

// knowsAdmin reports whether the kvmount binary bin accepts an [admin]
// table (binaries from before the admin endpoint refuse it).
func knowsAdmin(b *testing.B, bin string) bool {
	return accepts(b, bin, "[admin]\naddress = \"\"\n")
}

// accepts reports whether kvmount check of the binary bin accepts config.
func accepts(b *testing.B, bin, config string) bool {
	b.Helper()
	path := filepath.Join(b.TempDir(), "probe.toml")
	if err := os.WriteFile(path, []byte(config), 0o644); err != nil {
		b.Fatal(err)
	}
	return exec.Command(bin, "check", "-config", path).Run() == nil
}

// noAdmin is the [admin] table that turns off every admin endpoint the
// binary bin knows: the TCP address and, where it has one, the unix socket
// (so that two daemons of a benchmark never share /run/kvmount).
func noAdmin(b *testing.B, bin string) string {
	if withSocket := "[admin]\naddress = \"\"\nsocket = \"\"\n"; accepts(b, bin, withSocket) {
		return withSocket
	}
	if knowsAdmin(b, bin) {
		return "[admin]\naddress = \"\"\n"
	}
	return "" // a binary from before the admin endpoint
}

// BenchmarkPutToFile is the latency from a put of one key, in etcd and in
// Consul, to the new content being visible in a one-key mount on disk or
// tmpfs. Run with -benchtime 1000x or more: percentiles are over b.N
// sequential updates.
//
// Each case runs kvmount ("head") side by side with the floor
// (floor_bench_test.go: a process that only watches its key and switches
// ..data, fsyncing on disk as kvmount does) and the split floor (the same
// in two processes, the watcher handing each value to a writer over a
// socketpair: the least a privilege separation adds), each on its own key
// of the same store, and alternates updates between them (which goes
// first rotates too), so that all see the same machine at the same
// moments: the metrics are prefixed "floor-", "split-floor-" and "head-";
// "head/floor-" and "head/split-floor-" give the ratios of the p50s and
// of the p99s, and "split-floor/floor-" the split floor's own. With
// $KVMOUNT_BENCH_BASELINE set to a kvmount binary built from another
// commit, that binary runs beside them as "baseline", and
// "head/baseline-" gives its ratios too.
func BenchmarkPutToFile(b *testing.B) {
	baseline := os.Getenv("KVMOUNT_BENCH_BASELINE")
	for _, s := range []struct {
		name   string
		store  func(*testing.B) benchStore
		medium string
	}{{"etcd/disk", etcdStore, "disk"}, {"etcd/tmpfs", etcdStore, "tmpfs"}, {"consul/disk", consulStore, "disk"}, {"consul/tmpfs", consulStore, "tmpfs"}} {
		b.Run(s.name, func(b *testing.B) {
			store := s.store(b)
			names := []string{"floor", "split-floor", "head"}
			if baseline != "" {
				names = []string{"floor", "split-floor", "baseline", "head"}
			}
			sides := make([]updateSide, len(names))
			for i, name := range names {
				sides[i].name = name
				sides[i].store = store
				sides[i].store.prefix = fmt.Sprintf("%s%s/", store.prefix, name) // each its own keys
				switch name {
				case "floor":
					sides[i].dir = startFloor(b, sides[i].store, store.endpoint, s.medium, "one")
				case "split-floor":
					sides[i].dir = startFloor(b, sides[i].store, store.endpoint, s.medium, "split")
				case "baseline":
					sides[i].dir = benchDaemonWith(b, sides[i].store, 1, s.medium, benchExtras{bin: baseline})
				default:
					sides[i].dir = benchDaemonWith(b, sides[i].store, 1, s.medium, benchExtras{})
				}
			}
			measureSideBySide(b, sides)
		})
	}
}

// updateSide is one of the mounts measureSideBySide compares.
type updateSide struct {
	name  string
	store benchStore
	dir   string
	// total and after are the latencies from the put, and from its
	// commit, to the switch of ..data.
	total, after []time.Duration
}

// measureSideBySide is measureUpdates for several mounts at once: each
// iteration updates each side's one key in turn, in an order that rotates
// by one every iteration. It reports each side's percentiles, prefixed by
// its name, the ratios of the last side's p50s and p99s to each other
// side's ("head/floor-e2e-p50"), and those of the sides between to the
// first ("split-floor/floor-e2e-p50").
func measureSideBySide(b *testing.B, sides []updateSide) {
	watchers := make([]*switchWatcher, len(sides))
	order := make([]int, len(sides))
	for i := range sides {
		watchers[i] = watchSwitches(b, sides[i].dir)
		sides[i].total, sides[i].after = make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
		order[i] = i
	}
	b.ResetTimer()
	for i := range b.N {
		order = append(order[1:], order[0])
		for _, j := range order {
			side := &sides[j]
			value := fmt.Sprintf("update %d", i)
			start := time.Now()
			if err := side.store.put(side.store.prefix+"key-00000", value); err != nil {
				b.Fatal(err)
			}
			committed := time.Now()
			watchers[j].wait(b)
			end := time.Now()
			side.total = append(side.total, end.Sub(start))
			side.after = append(side.after, end.Sub(committed))
			b.StopTimer()
			if got, err := os.ReadFile(filepath.Join(side.dir, "key-00000")); err != nil || string(got) != value {
				b.Fatalf("%s: after the switch key-00000 = %q, %v; want %q", side.name, got, err, value)
			}
			b.StartTimer()
		}
	}
	b.StopTimer()
	type pcts struct{ p50, p99 float64 }
	e2e := make([]pcts, len(sides))
	after := make([]float64, len(sides))
	for i, side := range sides {
		e2e[i].p50 = report(b, side.name+"-e2e", side.total)
		e2e[i].p99 = percentile(side.total, 0.99)
		after[i] = report(b, side.name+"-after-commit", side.after)
	}
	ratios := func(of, to int) {
		ratio := sides[of].name + "/" + sides[to].name
		b.ReportMetric(e2e[of].p50/e2e[to].p50, ratio+"-e2e-p50")
		b.ReportMetric(e2e[of].p99/e2e[to].p99, ratio+"-e2e-p99")
		b.ReportMetric(after[of]/after[to], ratio+"-after-commit-p50")
	}
	last := len(sides) - 1
	for i := range last {
		ratios(last, i)
	}
	for i := 1; i < last; i++ {
		ratios(i, 0)
	}
}

// BenchmarkOneChangeIn1000KeyMount is the latency, through etcd, when the
// mount holds 1,000 keys and each update changes one of them, on disk and
// on tmpfs.
//
// The /template variants add a template that lists all 1,000 keys into one
// more file of the same mount, beside the same mount without it in the
// same run: what rendering adds to an update.
func BenchmarkOneChangeIn1000KeyMount(b *testing.B) {
	const template = "  [[mount.templates]]\n  path = \"all.conf\"\n  text = \"{{ range tree \\\"\\\" }}{{ .Key }} {{ .Value }}\\n{{ end }}\"\n"
	for _, medium := range []string{"disk", "tmpfs"} {
		for _, withTemplate := range []bool{false, true} {
			name, extra := medium, benchExtras{}
			if withTemplate {
				name, extra.mount = medium+"/template", template
			}
			b.Run(name, func(b *testing.B) {
				store := etcdStore(b)
				dir := benchDaemonWith(b, store, 1000, medium, extra)
				measureUpdates(b, store, dir, func(i int) string { return fmt.Sprintf("key-%05d", (i*7)%1000) })
			})
		}
	}
}

// BenchmarkObservability measures what the admin endpoint and notification
// cost: two daemons follow two prefixes of one etcd, one plain and one with
// the admin endpoint (scraped once per update) and a command notifier
// (`true`) after a webhook; updates alternate between them, and which goes
// first alternates too, so that both see the same machine at the same
// moments. It reports both propagation
// latencies and, for the observed daemon, the time from the switch of
// ..data to the webhook's arrival (the notifier's start).
func BenchmarkObservability(b *testing.B) {
	for _, medium := range []string{"disk", "tmpfs"} {
		b.Run(medium, func(b *testing.B) {
			store := etcdStore(b)
			arrived := make(chan time.Time, 1)
			hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				t := time.Now()
				select {
				case arrived <- t:
				default:
				}
				_, _ = io.Copy(io.Discard, r.Body)
			}))
			b.Cleanup(hook.Close)
			plainStore, observedStore := store, store
			plainStore.prefix, observedStore.prefix = "/plain/", "/observed/"
			plain := benchDaemonWith(b, plainStore, 1, medium, benchExtras{})
			socket := filepath.Join(b.TempDir(), "admin.sock")
			observed := benchDaemonWith(b, observedStore, 1, medium, benchExtras{
				admin: "unix:" + socket,
				mount: fmt.Sprintf("  [[mount.notify]]\n  webhook = %q\n  [[mount.notify]]\n  command = [\"true\"]\n", hook.URL),
			})
			scrape := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", socket)
			}}}
			wp, wo := watchSwitches(b, plain), watchSwitches(b, observed)
			var plainLat, obsLat, notifyLat []time.Duration
			select {
			case <-arrived: // the first projection's notification
			case <-time.After(waitTimeout):
				b.Fatal("no notification of the first projection")
			}
			b.ResetTimer()
			type side struct {
				store benchStore
				w     *switchWatcher
				lat   *[]time.Duration
			}
			sides := []side{{plainStore, wp, &plainLat}, {observedStore, wo, &obsLat}}
			for i := range b.N {
				// Alternate which daemon goes first, so that neither
				// always follows the other's fsyncs.
				slices.Reverse(sides)
				for _, side := range sides {
					start := time.Now()
					if err := side.store.put(side.store.prefix+"key-00000", fmt.Sprintf("update %d", i)); err != nil {
						b.Fatal(err)
					}
					side.w.wait(b)
					switched := time.Now()
					*side.lat = append(*side.lat, switched.Sub(start))
					if side.w == wo {
						select {
						case t := <-arrived:
							notifyLat = append(notifyLat, t.Sub(switched))
						case <-time.After(waitTimeout):
							b.Fatal("no notification")
						}
						resp, err := scrape.Get("http://kvmount/metrics")
						if err != nil {
							b.Fatal(err)
						}
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				}
			}
			b.StopTimer()
			report(b, "plain-e2e", plainLat)
			report(b, "observed-e2e", obsLat)
			report(b, "switch-to-notify", notifyLat)
		})
	}
}

// BenchmarkConsulManyPrefixes: one kvmount follows 1,000 prefixes of one
// Consul agent (1,000 tmpfs mounts, one key each), another follows one
// prefix (a tmpfs mount too);
// updates alternate between the single prefix and the last of the 1,000,
// so both latencies come from the same moments. It also reports the many-
// prefix daemon's connections to the agent, and then, in the same run, the
// store's own floor (see consulFloor): "floor-one-key" and "floor-1000-keys".
func BenchmarkConsulManyPrefixes(b *testing.B) {
	const n = 1000
	agent := consultest.Start(b)
	store := consulStoreOf(b, agent)
	var kv []string
	for i := range n {
		kv = append(kv, fmt.Sprintf("many/p%04d/key", i), fmt.Sprint(i))
	}
	for i := 0; i < len(kv); i += 128 {
		store.seed(kv[i:min(i+128, len(kv))])
	}
	single := store
	single.prefix = "solo/"
	soloDir := benchDaemonWith(b, single, 1, "tmpfs", benchExtras{})

	base := b.TempDir()
	var mounts strings.Builder
	for i := range n {
		dir := filepath.Join(base, "mnt", fmt.Sprintf("p%04d", i))
		fmt.Fprintf(&mounts, "[[mount]]\nname = \"p%04d\"\ndir = %q\nmedium = \"tmpfs\"\nsource = \"main\"\nprefix = \"many/p%04d/\"\n", i, dir, i)
		b.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	}
	cfg := fmt.Sprintf("state_dir = %q\nresync_interval = \"1h\"\n[admin]\naddress = \"\"\n[sources.main]\n%s%s", filepath.Join(base, "state"), store.source, mounts.String())
	configPath := filepath.Join(base, "kvmount.toml")
	if err := os.WriteFile(configPath, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(buildKvmount(b), "run", "-config", configPath)
	cmd.Stderr = io.Discard
	start := time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	lastDir := filepath.Join(base, "mnt", fmt.Sprintf("p%04d", n-1))
	waitProjected(b, n, 2*waitTimeout, "mounts projected", func(i int) bool {
		_, err := os.Lstat(filepath.Join(base, "mnt", fmt.Sprintf("p%04d", i), "key"))
		return err == nil
	})
	coldStart := time.Since(start)
	many := store
	many.prefix = fmt.Sprintf("many/p%04d/", n-1)
	ws, wm := watchSwitches(b, soloDir), watchSwitches(b, lastDir)
	var soloLat, manyLat []time.Duration
	b.ResetTimer()
	for i := range b.N {
		for _, side := range []struct {
			store benchStore
			w     *switchWatcher
			lat   *[]time.Duration
		}{{single, ws, &soloLat}, {many, wm, &manyLat}} {
			t0 := time.Now()
			if err := side.store.put(side.store.prefix+"key", fmt.Sprintf("update %d", i)); err != nil {
				b.Fatal(err)
			}
			side.w.wait(b)
			*side.lat = append(*side.lat, time.Since(t0))
		}
	}
	b.StopTimer()
	report(b, "one-prefix-e2e", soloLat)
	report(b, "1000-prefixes-e2e", manyLat)
	b.ReportMetric(coldStart.Seconds(), "1000-mounts-projected-s")
	b.ReportMetric(float64(processConnections(b, cmd.Process.Pid, store.port)), "agent-connections")
	floorOne, floorMany := consulFloor(b, agent, n, b.N)
	report(b, "floor-one-key", floorOne)
	report(b, "floor-1000-keys", floorMany)
}

// consulFloor measures what the store itself takes, without kvmount: from
// the start of a put to the return of a bare API client's blocking query
// (the agent's answer, its transfer uncompressed, as kvmount reads a
// loopback agent, and the client's decoding), on a prefix of n keys, one
// per subprefix as in BenchmarkConsulManyPrefixes, and on a prefix of one
// key; updates alternate between the two. Its prefixes lie apart from the
// daemons', so no daemon wakes.
func consulFloor(b *testing.B, agent *consultest.Agent, n, updates int) (one, many []time.Duration) {
	b.Helper()
	cfg := api.DefaultConfig()
	cfg.Address = agent.Addr()
	cfg.Transport.DisableCompression = true
	client, err := api.NewClient(cfg)
	if err != nil {
		b.Fatal(err)
	}
	var kv []string
	for i := range n {
		kv = append(kv, fmt.Sprintf("floor/many/p%04d/key", i), fmt.Sprint(i))
	}
	kv = append(kv, "floor/one/key", "0")
	for i := 0; i < len(kv); i += 128 {
		consultest.Txn(b, client, kv[i:min(i+128, len(kv))]...)
	}
	measure := func(prefix, key string, i int) time.Duration {
		_, meta, err := client.KV().List(prefix, nil)
		if err != nil {
			b.Fatal(err)
		}
		returned := make(chan time.Time, 1)
		go func() {
			_, _, err := client.KV().List(prefix, &api.QueryOptions{WaitIndex: meta.LastIndex, WaitTime: time.Minute})
			if err != nil {
				b.Error(err)
			}
			returned <- time.Now()
		}()
		time.Sleep(5 * time.Millisecond) // the query is parked at the agent
		t0 := time.Now()
		if _, err := client.KV().Put(&api.KVPair{Key: key, Value: []byte(fmt.Sprint("update ", i))}, nil); err != nil {
			b.Fatal(err)
		}
		return (<-returned).Sub(t0)
	}
	for i := range updates {
		one = append(one, measure("floor/one/", "floor/one/key", i))
		many = append(many, measure("floor/many/", fmt.Sprintf("floor/many/p%04d/key", n-1), i))
	}
	return one, many
}

// waitProjected polls every 10 ms until projected(i) holds for every i
// below n, and fails the benchmark after timeout with how many did
// ("only 7 of 100 <what>"), and for the first few that did not, what
// explain (when not nil) says of them.
func waitProjected(b *testing.B, n int, timeout time.Duration, what string, projected func(i int) bool, explain ...func(i int) string) {
	b.Helper()
	for deadline := time.Now().Add(timeout); ; time.Sleep(10 * time.Millisecond) {
		var missing []int
		for i := range n {
			if !projected(i) {
				missing = append(missing, i)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, i := range missing[:min(len(missing), 3)] {
				for _, f := range explain {
					b.Logf("#%d: %s", i, f(i))
				}
			}
			b.Fatalf("only %d of %d %s", n-len(missing), n, what)
		}
	}
}

// processConnections counts pid's established TCP connections to port.
func processConnections(b *testing.B, pid int, port int) int {
	ours := map[string]bool{}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, fd := range fds {
		if target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil && strings.HasPrefix(target, "socket:[") {
			ours[strings.TrimSuffix(strings.TrimPrefix(target, "socket:["), "]")] = true
		}
	}
	hexPort := fmt.Sprintf(":%04X", port)
	n := 0
	for _, table := range []string{"tcp", "tcp6"} {
		data, _ := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		for _, line := range strings.Split(string(data), "\n") {
			f := strings.Fields(line)
			if len(f) > 9 && strings.HasSuffix(f[2], hexPort) && f[3] == "01" && ours[f[9]] {
				n++
			}
		}
	}
	return n
}

// BenchmarkScale100kKeys starts kvmount with 1,000 mounts of 100 keys each
// (100,000 keys, 7.5 MB of values) on one etcd, on disk, and reports:
//
//   - cold-start-s: from the start with nothing on disk until every mount
//     is projected, beside floor-s, a plain program creating the same
//     files (1,000 directories at once, each file written and fsynced,
//     then its directory fsynced) in the same temporary directory in the
//     same run, and their ratio cold/floor; and beside floor-layout-s, the
//     same program creating the atomic writer's layout as well (version
//     directory, ..data and a symlink per file), and cold/floor-layout;
//   - cold-cpu-monitor-s: the CPU time (user and system, as
//     restart-cpu-monitor-s below) the monitor had used when the cold
//     start was over;
//   - floor-bulkprocs-s: the files-only floor again, with as many Ps
//     (GOMAXPROCS) as kvmount gives bulk setups (reconcile.BulkProcs), and
//     cold/floor-bulkprocs: how much of the gap is the Go scheduler's;
//   - rss-MiB and rss-B/key: resident memory at rest, of kvmount and its
//     worker together (pss-MiB without their shared pages counted twice;
//     rss-worker-MiB the worker's alone: 0 for a kvmount without one);
//   - restart-write-s: from a restart (SIGTERM, start again) until a
//     write to the last mount by name, made right after the start, is
//     visible, and restart-write-first-s the same for the first mount
//     (written just before): mounts are read in no promised order, so
//     the later of the two is nearer the time until every mount is
//     current;
//   - restart-cpu-monitor-s and restart-cpu-worker-s: the CPU time (user
//     and system, /proc/PID/stat, in 10 ms ticks) the restarted monitor
//     and its worker had used when the later of those writes was seen —
//     what a restart costs, less exposed than its duration to what else
//     the machine's disk and CPUs do;
//   - pss-anon-monitor-updated-MiB: the monitor's anonymous memory at
//     rest after every mount was updated once, one after another (one
//     key each), before the restart; pss-anon-monitor-MiB is the same
//     after the cold start;
//   - pss-anon-worker-updated-MiB: the same of the worker;
//   - pss-anon-monitor-settled-MiB and pss-anon-worker-settled-MiB, with
//     KVMOUNT_BENCH_SETTLE set to a duration: the same as
//     pss-anon-monitor-updated-MiB and pss-anon-worker-updated-MiB once
//     that much longer at rest (the Go runtime forces a collection every 2 minutes
//     and gives back what lies beyond the heap's goal in the background);
//   - pss-anon-monitor-worker-killed-MiB: the same after the restart,
//     once its worker was killed (SIGKILL) and the next one answered
//     every mount, equal to what it holds — as Unchanged since
//     2026-12-03, whole before —, taken 13 s later (8 s before
//     2026-11-27's third session);
//
// and fails if the restart or the worker's end rewrote an unchanged
// mount.
//
// b.N is ignored beyond the first iteration: it is one measurement (run
// with -benchtime 1x).
//
// Nothing is deleted until the benchmark binary exits (keepUntilExit): on
// ext4 without a journal, inodes deleted in the last 60 s (360 s while
// their inode table block is dirty) are skipped when new ones are
// allocated (fs/ext4/ialloc.c, recently_deleted), which made whichever
// phase followed the removal of another's 100,000 files pay for it. Leave
// six minutes after removing large trees from the same file system before
// a run.
//
// With $KVMOUNT_BENCH_BASELINE set (see BenchmarkPutToFile), that binary
// ("/baseline") and then this tree's ("/head") each run against an etcd of
// their own, one after the other in one run.
func BenchmarkScale100kKeys(b *testing.B) {
	baseline := os.Getenv("KVMOUNT_BENCH_BASELINE")
	if baseline == "" {
		scale100kKeys(b, buildKvmount(b))
		return
	}
	b.Run("baseline", func(b *testing.B) { scale100kKeys(b, baseline) })
	b.Run("head", func(b *testing.B) { scale100kKeys(b, buildKvmount(b)) })
}

// evictBinary drops bin's pages from the page cache (an fsync, then
// posix_fadvise POSIX_FADV_DONTNEED), so that the daemon started next
// reads its binary from disk as after a boot. A binary the Go linker has
// just written sits in the page cache in large folios (2 MiB on ext4 with
// Linux 6.18), and there a fault maps the whole large folio (exepages):
// the processes' file PSS then counts nearly the whole binary, whatever
// they run. With $KVMOUNT_BENCH_KEEP_BINARY_CACHE set, it does
// nothing: the conditions of the figures before 2026-11-28's.
func evictBinary(b *testing.B, bin string) {
	b.Helper()
	if os.Getenv("KVMOUNT_BENCH_KEEP_BINARY_CACHE") != "" {
		return
	}
	f, err := os.Open(bin)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		b.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		b.Fatal(err)
	}
}

// writeFsyncFloor creates dirs directories of files files each, holding
// value, below base, all directories at once: each file created, written
// and fsynced, then its directory fsynced. It is the floor a projection
// of the same files on the same disk cannot beat, and returns how long it
// took. With layout set it also creates the entries of the atomic writer's
// layout, as plainly: the files go into a subdirectory (fsynced), and the
// directory gets ..data, a symlink to it, and one symlink per file through
// ..data, then is fsynced; it still writes no manifest and no record.
func writeFsyncFloor(b *testing.B, base string, dirs, files int, value []byte, layout bool) time.Duration {
	b.Helper()
	syncDir := func(dir string) error {
		f, err := os.Open(dir)
		if err != nil {
			return err
		}
		defer f.Close()
		return f.Sync()
	}
	t0 := time.Now()
	var g errgroup.Group
	for d := range dirs {
		g.Go(func() error {
			dir := filepath.Join(base, fmt.Sprintf("d%04d", d))
			data := dir
			if layout {
				data = filepath.Join(dir, "..v1")
			}
			if err := os.MkdirAll(data, 0o755); err != nil {
				return err
			}
			for k := range files {
				f, err := os.OpenFile(filepath.Join(data, fmt.Sprintf("key-%03d", k)), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
				if err != nil {
					return err
				}
				_, err = f.Write(value)
				if err == nil {
					err = f.Sync()
				}
				if cerr := f.Close(); err == nil {
					err = cerr
				}
				if err != nil {
					return err
				}
			}
			if layout {
				if err := syncDir(data); err != nil {
					return err
				}
				if err := os.Symlink("..v1", filepath.Join(dir, "..data")); err != nil {
					return err
				}
				for k := range files {
					name := fmt.Sprintf("key-%03d", k)
					if err := os.Symlink(filepath.Join("..data", name), filepath.Join(dir, name)); err != nil {
						return err
					}
				}
			}
			return syncDir(dir)
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	return time.Since(t0)
}

// benchLog returns where a benchmark's kvmount logs: the file named by
// KVMOUNT_BENCH_LOG (appended to, to read a run's timeline afterwards), or
// nowhere.
func benchLog(b *testing.B) io.Writer {
	path := os.Getenv("KVMOUNT_BENCH_LOG")
	if path == "" {
		return io.Discard
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { f.Close() })
	return f
}

func scale100kKeys(b *testing.B, bin string) {
	const mounts, keys = 1000, 100
	store := etcdStore(b)
	value := strings.Repeat("v", 75)
	for m := range mounts {
		var kv []string
		for k := range keys {
			kv = append(kv, fmt.Sprintf("/scale/m%04d/key-%03d", m, k), value)
		}
		store.seed(kv)
	}
	base := keepUntilExit(b)
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "state_dir = %q\nresync_interval = \"1h\"\n%s[sources.main]\n%s", filepath.Join(base, "state"), noAdmin(b, bin), store.source)
	// KVMOUNT_BENCH_MOUNT_EXTRA adds settings to every mount (lines, each
	// ending in a newline), such as max_value_size = "64KiB", to compare.
	for m := range mounts {
		fmt.Fprintf(&cfg, "[[mount]]\nname = \"m%04d\"\ndir = %q\nsource = \"main\"\nprefix = \"/scale/m%04d/\"\n%s", m, filepath.Join(base, "mnt", fmt.Sprintf("m%04d", m)), m, os.Getenv("KVMOUNT_BENCH_MOUNT_EXTRA"))
	}
	configPath := filepath.Join(base, "kvmount.toml")
	if err := os.WriteFile(configPath, []byte(cfg.String()), 0o644); err != nil {
		b.Fatal(err)
	}
	last := filepath.Join(base, "mnt", fmt.Sprintf("m%04d", mounts-1))
	start := func() *exec.Cmd {
		cmd := exec.Command(bin, "run", "-config", configPath)
		cmd.Stderr = benchLog(b)
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		return cmd
	}
	stop := func(cmd *exec.Cmd) {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}
	allProjected := func() {
		deadline := time.Now().Add(10 * time.Minute)
		for m := mounts - 1; m >= 0; {
			if _, err := os.Stat(filepath.Join(base, "mnt", fmt.Sprintf("m%04d", m), "key-099")); err == nil {
				m--
				continue
			}
			if time.Now().After(deadline) {
				b.Fatalf("mount m%04d never projected", m)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	flush := func() {
		if err := exec.Command("sync").Run(); err != nil {
			b.Fatal(err)
		}
	}
	floorOf := func(name string, layout bool, procs int) time.Duration {
		flush()
		defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(procs))
		return writeFsyncFloor(b, filepath.Join(base, name), mounts, keys, []byte(value), layout)
	}
	floor := floorOf("floor", false, runtime.GOMAXPROCS(0))
	floorLayout := floorOf("floor-layout", true, runtime.GOMAXPROCS(0))
	floorProcs := floorOf("floor-bulkprocs", false, max(runtime.GOMAXPROCS(0), reconcile.BulkProcs))
	flush()
	evictBinary(b, bin)
	b.ResetTimer()
	t0 := time.Now()
	cmd := start()
	allProjected()
	cold := time.Since(t0)
	coldCPU := cpuTime(b, cmd.Process.Pid)
	// At rest: past the replaced versions' grace period (5 s) and a
	// garbage collection or two.
	time.Sleep(8 * time.Second)
	rss, pss, workerRSS := treeMemory(b, cmd.Process.Pid)
	monitorAnon, workerAnon, filePSS := memoryParts(b, cmd.Process.Pid)
	// Every mount updated once (one key each, the mounts one after
	// another): as many payloads through the monitor as the cold start's,
	// without its bulk setups, after which the monitor returns its free
	// memory. Then at rest again.
	for m := range mounts {
		if err := store.put(fmt.Sprintf("/scale/m%04d/key-000", m), "updated"); err != nil {
			b.Fatal(err)
		}
	}
	for deadline, m := time.Now().Add(5*time.Minute), mounts-1; m >= 0; {
		if data, _ := os.ReadFile(filepath.Join(base, "mnt", fmt.Sprintf("m%04d", m), "key-000")); string(data) == "updated" {
			m--
			continue
		}
		if time.Now().After(deadline) {
			b.Fatalf("the update of m%04d never arrived", m)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(8 * time.Second)
	monitorAnonUpdated, workerAnonUpdated, _ := memoryParts(b, cmd.Process.Pid)
	settled, workerSettled := int64(-1), int64(-1)
	if d, err := time.ParseDuration(os.Getenv("KVMOUNT_BENCH_SETTLE")); err == nil && d > 0 {
		time.Sleep(d)
		settled, workerSettled, _ = memoryParts(b, cmd.Process.Pid)
	}
	stop(cmd)
	unchanged := filepath.Join(base, "mnt", "m0001", "..data")
	first, err := os.Readlink(unchanged)
	if err != nil {
		b.Fatal(err)
	}
	// After the restart, a write to the first mount by name and one to
	// the last: mounts are read in no promised order, and the time to
	// the later of the two is nearer the time to every mount's first
	// read than either alone.
	t0 = time.Now()
	cmd = start()
	for _, m := range []int{0, mounts - 1} {
		if err := store.put(fmt.Sprintf("/scale/m%04d/key-099", m), "after restart"); err != nil {
			b.Fatal(err)
		}
	}
	var restartFirst, restart, restartCPU, restartWorkerCPU time.Duration
	for deadline := time.Now().Add(5 * time.Minute); restartFirst == 0 || restart == 0; time.Sleep(5 * time.Millisecond) {
		if data, _ := os.ReadFile(filepath.Join(base, "mnt", "m0000", "key-099")); restartFirst == 0 && string(data) == "after restart" {
			restartFirst = time.Since(t0)
		}
		if data, _ := os.ReadFile(filepath.Join(last, "key-099")); restart == 0 && string(data) == "after restart" {
			restart = time.Since(t0)
		}
		if restartFirst != 0 && restart != 0 {
			restartCPU = cpuTime(b, cmd.Process.Pid)
			for _, child := range childPIDs(b, cmd.Process.Pid) {
				restartWorkerCPU += cpuTime(b, child)
			}
		}
		if time.Now().After(deadline) {
			b.Fatal("the writes after the restart never arrived")
		}
	}
	// The worker killed, as a crash would: the monitor starts another,
	// which reads every mount again and sends its payloads, equal to
	// those the monitor holds. A write to the last mount after it tells
	// when all have come; the monitor's memory is then taken at rest.
	workers := childPIDs(b, cmd.Process.Pid)
	if len(workers) != 1 {
		b.Fatalf("%d workers; want 1", len(workers))
	}
	if err := syscall.Kill(workers[0], syscall.SIGKILL); err != nil {
		b.Fatal(err)
	}
	if err := store.put(fmt.Sprintf("/scale/m%04d/key-099", mounts-1), "after the worker"); err != nil {
		b.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if data, _ := os.ReadFile(filepath.Join(last, "key-099")); string(data) == "after the worker" {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("the write after the worker's end never arrived")
		}
	}
	// At rest: past the quiet that ends a burst (burstQuiet), after which
	// the monitor gives its free heap back.
	time.Sleep(burstQuiet + 3*time.Second)
	monitorAnonAfter, _, _ := memoryParts(b, cmd.Process.Pid)
	stop(cmd)
	b.StopTimer()
	if now, err := os.Readlink(unchanged); err != nil || now != first {
		b.Fatalf("the restart or the worker's end rewrote the unchanged mount m0001: ..data was %s, is %s (%v)", first, now, err)
	}
	b.ReportMetric(cold.Seconds(), "cold-start-s")
	b.ReportMetric(floor.Seconds(), "floor-s")
	b.ReportMetric(cold.Seconds()/floor.Seconds(), "cold/floor")
	b.ReportMetric(coldCPU.Seconds(), "cold-cpu-monitor-s")
	b.ReportMetric(floorLayout.Seconds(), "floor-layout-s")
	b.ReportMetric(cold.Seconds()/floorLayout.Seconds(), "cold/floor-layout")
	b.ReportMetric(floorProcs.Seconds(), "floor-bulkprocs-s")
	b.ReportMetric(cold.Seconds()/floorProcs.Seconds(), "cold/floor-bulkprocs")
	b.ReportMetric(restart.Seconds(), "restart-write-s")
	b.ReportMetric(restartFirst.Seconds(), "restart-write-first-s")
	b.ReportMetric(restartCPU.Seconds(), "restart-cpu-monitor-s")
	b.ReportMetric(restartWorkerCPU.Seconds(), "restart-cpu-worker-s")
	b.ReportMetric(float64(rss)/(1<<20), "rss-MiB")
	b.ReportMetric(float64(rss)/(mounts*keys), "rss-B/key")
	b.ReportMetric(float64(pss)/(1<<20), "pss-MiB")
	b.ReportMetric(float64(workerRSS)/(1<<20), "rss-worker-MiB")
	b.ReportMetric(float64(monitorAnon)/(1<<20), "pss-anon-monitor-MiB")
	b.ReportMetric(float64(monitorAnonUpdated)/(1<<20), "pss-anon-monitor-updated-MiB")
	b.ReportMetric(float64(workerAnonUpdated)/(1<<20), "pss-anon-worker-updated-MiB")
	if settled >= 0 {
		b.ReportMetric(float64(settled)/(1<<20), "pss-anon-monitor-settled-MiB")
		b.ReportMetric(float64(workerSettled)/(1<<20), "pss-anon-worker-settled-MiB")
	}
	b.ReportMetric(float64(monitorAnonAfter)/(1<<20), "pss-anon-monitor-worker-killed-MiB")
	b.ReportMetric(float64(workerAnon)/(1<<20), "pss-anon-worker-MiB")
	b.ReportMetric(float64(filePSS)/(1<<20), "pss-file-MiB")
}

// memoryParts splits the PSS of kvmount as process pid and its workers
// (smaps_rollup): the monitor's anonymous memory (its heap, stacks and
// runtime), the workers' together, and the pages of files — the binary's,
// shared by all — of every process together.
func memoryParts(b *testing.B, pid int) (monitorAnon, workerAnon, file int64) {
	m := processMemory(b, pid)
	monitorAnon, file = m["Pss_Anon"], m["Pss_File"]
	for _, child := range childPIDs(b, pid) {
		w := processMemory(b, child)
		workerAnon += w["Pss_Anon"]
		file += w["Pss_File"]
	}
	return monitorAnon, workerAnon, file
}

// treeMemory returns the memory at rest of kvmount as process pid and its
// children (the worker, since issue 28): the sum of their resident set
// sizes, which counts the binary's pages they share twice; the sum of
// their proportional set sizes, which does not (processMemory); and the
// children's resident set size alone.
func treeMemory(b *testing.B, pid int) (rss, pss, childRSS int64) {
	rss = rssBytes(b, pid)
	pss = processMemory(b, pid)["Pss"]
	for _, child := range childPIDs(b, pid) {
		r := rssBytes(b, child)
		rss += r
		childRSS += r
		pss += processMemory(b, child)["Pss"]
	}
	return rss, pss, childRSS
}

// childPIDs returns the processes whose parent is pid, from every thread's
// /proc/pid/task/TID/children (a Go program starts a child from any of
// its threads).
func childPIDs(b *testing.B, pid int) []int {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		b.Fatal(err)
	}
	var out []int
	for _, task := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, task.Name()))
		if err != nil {
			continue // the thread ended
		}
		for _, f := range strings.Fields(string(data)) {
			if child, err := strconv.Atoi(f); err == nil {
				out = append(out, child)
			}
		}
	}
	return out
}

// cpuTime returns the CPU time, user and system, that process pid and all
// its threads have used, from /proc/pid/stat (utime and stime, in ticks of
// 1/100 s: USER_HZ, proc(5)).
func cpuTime(b *testing.B, pid int) time.Duration {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// The fields after the command's ")" start with the third, state;
	// utime and stime are the 14th and 15th.
	i := strings.LastIndexByte(string(data), ')')
	if i < 0 {
		b.Fatalf("/proc/%d/stat: %q", pid, data)
	}
	fields := strings.Fields(string(data[i+1:]))
	if len(fields) < 13 {
		b.Fatalf("/proc/%d/stat: %q", pid, data)
	}
	var ticks int64
	for _, f := range fields[11:13] {
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			b.Fatalf("/proc/%d/stat: %q", pid, data)
		}
		ticks += n
	}
	return time.Duration(ticks) * (time.Second / 100)
}

// rssBytes returns the resident set size of pid, from /proc/pid/status.
func rssBytes(b *testing.B, pid int) int64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	b.Fatal("no VmRSS")
	return 0
}
