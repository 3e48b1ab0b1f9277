package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/internal/embedetcd"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/faultproxy"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/source"
	"github.com/kvmount/kvmount/source/consul"
	"github.com/kvmount/kvmount/source/etcd"
	httpsource "github.com/kvmount/kvmount/source/http"
	"github.com/kvmount/kvmount/source/vault"
)

// waitTimeout bounds every wait in these tests. Changes propagate in
// milliseconds; the bound is reached only when something is broken.
const waitTimeout = 30 * time.Second

// harness runs the daemon in-process against a real store: etcd unless a
// test sets sources.
type harness struct {
	t        *testing.T
	etcd     *embedetcd.Server
	cli      *clientv3.Client
	base     string // temporary directory for everything
	config   string // configuration file
	endpoint string // what kvmount dials (etcd, or a proxy in front of it)
	// sources returns the [sources.*] tables of the configuration; nil
	// means the etcd source "main" dialing endpoint.
	sources func() string
	// admin is the admin endpoint's address; "" (the default in tests)
	// turns it off.
	admin string
	// workerMode is Options.workerMode: "" for the daemon's worker.
	workerMode string
	// heapQuiet is Options.heapQuiet: zero for burstQuiet.
	heapQuiet time.Duration
	// settings are further top-level settings of the configuration, a
	// line each, such as max_total_size.
	settings string
	// resync is the configuration's resync_interval: "1s" when "".
	resync   string
	logs     *testlog.Buffer
	reload   chan os.Signal
	notified chan string
	// statusLines are the STATUS= lines sent to systemd, in order.
	statusMu    sync.Mutex
	statusLines []string
	cancel      context.CancelFunc
	done        chan error
}

// newHarness returns a harness with its own etcd.
func newHarness(t *testing.T) *harness {
	t.Helper()
	// Started first, so that it stops last: after the daemon, whose open
	// watch would otherwise hold etcd's shutdown for its request timeout.
	srv, cli := etcdtest.Start(t)
	h := newBareHarness(t)
	h.etcd, h.cli, h.endpoint = srv, cli, srv.Endpoint()
	return h
}

// newBareHarness returns a harness without a store; the test sets sources.
func newBareHarness(t *testing.T) *harness {
	t.Helper()
	// Reachable by other users (t.TempDir's are 0700): check commands run
	// as the mount's user or nobody.
	base := roottest.TempDir(t)
	h := &harness{t: t, base: base, config: filepath.Join(base, "kvmount.toml"), logs: &testlog.Buffer{}}
	t.Cleanup(func() {
		h.stop()
		// After the stop: a running daemon mounts a tmpfs it finds gone
		// again.
		roottest.UnmountUnder(t, base)
		if t.Failed() {
			t.Logf("kvmount logs:\n%s", h.logs)
		}
	})
	return h
}

// statusSocket is the private admin socket: /status and every route.
func (h *harness) statusSocket() string { return h.path("run", "kvmount.sock") }

// path returns a path inside the harness's temporary directory.
func (h *harness) path(parts ...string) string {
	return filepath.Join(append([]string{h.base}, parts...)...)
}

// writeConfig writes the configuration file: a header with the state
// directory and a fast resync, the sources (by default the etcd source
// "main"), then mounts.
func (h *harness) writeConfig(mounts string) {
	h.t.Helper()
	sources := fmt.Sprintf("[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\ndial_timeout = \"1s\"\n", h.endpoint)
	if h.sources != nil {
		sources = h.sources()
	}
	resync := h.resync
	if resync == "" {
		resync = "1s"
	}
	body := fmt.Sprintf(`state_dir = %q
resync_interval = %q
log_level = "debug"
%s
[admin]
address = %q
socket = %q

%s
%s`, h.path("state"), resync, h.settings, h.admin, h.statusSocket(), sources, mounts)
	if err := os.WriteFile(h.config, []byte(body), 0o644); err != nil {
		h.t.Fatal(err)
	}
}

// mount returns a [[mount]] table for name, projecting prefix into a
// directory of the harness.
func (h *harness) mount(name, prefix string, extra ...string) string {
	return fmt.Sprintf("[[mount]]\nname = %q\ndir = %q\nsource = \"main\"\nprefix = %q\n%s\n", name, h.path("mnt", name), prefix, strings.Join(extra, "\n"))
}

func (h *harness) options() Options {
	return Options{
		ConfigPath: h.config,
		Registry:   testRegistry(),
		LogOutput:  h.logs,
		workerMode: h.workerMode,
		heapQuiet:  h.heapQuiet,
	}
}

// start runs the daemon until stop.
func (h *harness) start() {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h.reload = make(chan os.Signal, 1)
	h.notified = make(chan string, 100)
	opts := h.options()
	opts.Reload = h.reload
	opts.Notify = func(state string) {
		if line, ok := strings.CutPrefix(state, "status="); ok {
			h.statusMu.Lock()
			h.statusLines = append(h.statusLines, line)
			h.statusMu.Unlock()
			return
		}
		select {
		case h.notified <- state:
		default:
		}
	}
	h.cancel, h.done = cancel, make(chan error, 1)
	go func() { h.done <- Run(ctx, opts) }()
}

// stop stops the daemon and checks that it stopped cleanly.
func (h *harness) stop() {
	h.t.Helper()
	if h.cancel == nil {
		return
	}
	h.cancel()
	h.cancel = nil
	select {
	case err := <-h.done:
		if err != nil {
			h.t.Errorf("Run = %v; want nil after a clean stop", err)
		}
	case <-time.After(waitTimeout):
		h.t.Fatalf("Run did not return after cancel")
	}
}

// sighup asks the daemon to reload its configuration.
func (h *harness) sighup() { h.reload <- syscall.SIGHUP }

// waitReady waits for the daemon to report every mount settled.
func (h *harness) waitReady() {
	h.t.Helper()
	deadline := time.After(waitTimeout)
	for {
		select {
		case s := <-h.notified:
			if s == "ready" {
				return
			}
		case <-deadline:
			h.t.Fatal("daemon never became ready")
		}
	}
}

func (h *harness) put(kv ...string) {
	h.t.Helper()
	etcdtest.Put(h.t, h.cli, kv...)
}

// content returns the files of the mount at dir, read through the visible
// symlinks as a service would, and the version ..data points at; an entry
// of the version that is not a regular file is not opened but shown as
// such. A missing mount is nil.
func content(dir string) (map[string]string, string) {
	version, err := os.Readlink(filepath.Join(dir, projector.DataDirName))
	if err != nil {
		return nil, ""
	}
	files := map[string]string{}
	root := filepath.Join(dir, version)
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "..manifest" {
			return nil // an older kvmount's, in a benchmark's baseline binary
		}
		if !d.Type().IsRegular() {
			// A FIFO or symlink a test's user planted: never opened.
			files[rel] = "(not a regular file: " + d.Type().String() + ")"
			return nil
		}
		data, err := os.ReadFile(filepath.Join(dir, rel))
		if err != nil {
			return err
		}
		files[rel] = string(data)
		return nil
	})
	if err != nil {
		return nil, ""
	}
	return files, version
}

// waitContent waits until the mount at dir holds exactly want.
func (h *harness) waitContent(dir string, want map[string]string) string {
	h.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	seen := ""
	for {
		// A version directory never changes once ..data names it: read
		// the files again only after a switch.
		if version, _ := os.Readlink(filepath.Join(dir, projector.DataDirName)); version != seen || version == "" {
			got, version := content(dir)
			if got != nil && maps.Equal(got, want) {
				return version
			}
			seen = version
			if time.Now().After(deadline) {
				h.t.Fatalf("mount %s holds %s; want %s", dir, summary(got), summary(want))
			}
		}
		if time.Now().After(deadline) {
			got, _ := content(dir)
			h.t.Fatalf("mount %s holds %s; want %s", dir, summary(got), summary(want))
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// summary renders a mount's content for a failure message, shortened when
// it is large.
func summary(m map[string]string) string {
	if len(m) > 20 {
		return fmt.Sprintf("%d files", len(m))
	}
	return fmt.Sprint(m)
}

// waitLog waits until a log line contains every one of parts.
func (h *harness) waitLog(parts ...string) {
	h.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for h.logs.Count(parts...) == 0 {
		if time.Now().After(deadline) {
			h.t.Fatalf("no log line with %q", parts)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitAdmin waits until path on the admin socket answers with a body
// containing want. /status and /metrics follow the reconciler's passes,
// so they may lag the log line of the operation they report by one pass.
func (h *harness) waitAdmin(socket, path, want string) {
	h.t.Helper()
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		_, body := unixGet(h.t, socket, path)
		if strings.Contains(body, want) {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s lacks %s:\n%s", path, want, body)
		}
	}
}

// waitGone waits until path does not exist.
func (h *harness) waitGone(path string) {
	h.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%s still exists", path)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// entries lists a directory's names.
func entries(t *testing.T, dir string) []string {
	t.Helper()
	list, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range list {
		names = append(names, e.Name())
	}
	return names
}

// readVersions reads, in a loop until the returned stop is called, the
// files of the version ..data names, resolving ..data once per round as a
// careful reader does, and hands each complete set of values to check.
// Call it once the mount is projected: from then on an unreadable ..data is
// a failure, and so is a missing file in a version that ..data still names
// afterwards. A round whose version was replaced and removed meanwhile is
// skipped (kvmount keeps replaced versions for a grace period, so that is
// rare). stop returns how many complete rounds there were.
func readVersions(t *testing.T, dir string, files []string, check func(version string, values []string)) (stop func() int64) {
	done := make(chan struct{})
	var reads atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	data := filepath.Join(dir, projector.DataDirName)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			version, err := os.Readlink(data)
			if err != nil {
				t.Errorf("readlink ..data: %v", err)
				return
			}
			values := make([]string, 0, len(files))
			for _, name := range files {
				b, err := os.ReadFile(filepath.Join(dir, version, name))
				if errors.Is(err, fs.ErrNotExist) {
					if now, _ := os.Readlink(data); now == version {
						t.Errorf("%s/%s is missing while ..data names that version", version, name)
						return
					}
					break
				}
				if err != nil {
					t.Errorf("%s/%s: %v", version, name, err)
					return
				}
				values = append(values, string(b))
			}
			if len(values) == len(files) {
				reads.Add(1)
				check(version, values)
			}
		}
	}()
	return func() int64 {
		close(done)
		wg.Wait()
		return reads.Load()
	}
}

// proxyEtcd puts a fault proxy between kvmount and the harness's etcd, so
// that a test can cut the network, and points the etcd source at it.
func (h *harness) proxyEtcd() *faultproxy.Proxy {
	h.t.Helper()
	proxy, err := faultproxy.Start(strings.TrimPrefix(h.etcd.Endpoint(), "http://"))
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(proxy.Close)
	h.endpoint = "http://" + proxy.Addr()
	return proxy
}

// testRegistry is the registry of the tests: every source kind of
// kvmount's.
func testRegistry() *source.Registry {
	return source.NewRegistry(etcd.Kind(), consul.Kind(), httpsource.Kind(), vault.Kind())
}
