package daemon

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/embedetcd"
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

// benchDaemon runs kvmount against a real etcd, with fsync on both sides,
// projecting /bench/ into a disk mount, after seeding it with keys.
func benchDaemon(b *testing.B, keys int) (cli *clientv3.Client, dir string) {
	b.Helper()
	base := b.TempDir()
	srv, err := embedetcd.Start(filepath.Join(base, "etcd"), embedetcd.Options{Fsync: true})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(srv.Stop)
	cli, err = srv.Client()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cli.Close() })
	for i := 0; i < keys; i += 100 {
		var ops []clientv3.Op
		for j := i; j < min(i+100, keys); j++ {
			ops = append(ops, clientv3.OpPut(fmt.Sprintf("/bench/key-%05d", j), fmt.Sprintf("value %d, padded to look like a small config line", j)))
		}
		if _, err := cli.Txn(context.Background()).Then(ops...).Commit(); err != nil {
			b.Fatal(err)
		}
	}
	dir = filepath.Join(base, "mnt")
	cfg := fmt.Sprintf("state_dir = %q\nresync_interval = \"1h\"\n[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n[[mount]]\nname = \"bench\"\ndir = %q\nsource = \"main\"\nprefix = \"/bench/\"\n",
		filepath.Join(base, "state"), srv.Endpoint(), dir)
	configPath := filepath.Join(base, "kvmount.toml")
	if err := os.WriteFile(configPath, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}
	// kvmount runs as its own process, as in production: in this one, the
	// garbage collector would also scan the in-process etcd's heap.
	cmd := exec.Command(buildKvmount(b), "run", "-config", configPath)
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
		if got, _ := content(dir); len(got) == keys {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("mount never held %d keys", keys)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cli, dir
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// buildKvmount builds the kvmount binary once per benchmark run.
func buildKvmount(b *testing.B) string {
	b.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kvmount-bench")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "kvmount")
		out, err := exec.Command("go", "build", "-o", binPath, "../cmd/kvmount").CombinedOutput()
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
func measureUpdates(b *testing.B, cli *clientv3.Client, dir string, key func(i int) string) {
	w := watchSwitches(b, dir)
	total := make([]time.Duration, 0, b.N)
	after := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		k := key(i)
		value := fmt.Sprintf("update %d", i)
		start := time.Now()
		if _, err := cli.Put(context.Background(), "/bench/"+k, value); err != nil {
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

func report(b *testing.B, name string, d []time.Duration) {
	slices.Sort(d)
	pct := func(p float64) float64 {
		return float64(d[min(len(d)-1, int(p*float64(len(d))))]) / float64(time.Millisecond)
	}
	b.ReportMetric(pct(0.50), name+"-p50-ms")
	b.ReportMetric(pct(0.99), name+"-p99-ms")
	b.ReportMetric(float64(d[len(d)-1])/float64(time.Millisecond), name+"-max-ms")
}

// BenchmarkPutToFile is the latency from an etcd put of one key to the new
// content being visible in a one-key disk mount. Run with -benchtime 1000x
// or more: percentiles are over b.N sequential updates.
func BenchmarkPutToFile(b *testing.B) {
	cli, dir := benchDaemon(b, 1)
	measureUpdates(b, cli, dir, func(int) string { return "key-00000" })
}

// BenchmarkOneChangeIn1000KeyMount is the same latency when the mount holds
// 1,000 keys and each update changes one of them.
func BenchmarkOneChangeIn1000KeyMount(b *testing.B) {
	cli, dir := benchDaemon(b, 1000)
	measureUpdates(b, cli, dir, func(i int) string { return fmt.Sprintf("key-%05d", (i*7)%1000) })
}
