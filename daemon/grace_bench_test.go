package daemon

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/projector"
)

// BenchmarkReplacedGrace measures the trade-off of keep_replaced (README,
// "Replaced versions"), black-box against etcd, with the default (5 s) and
// with "0s" (the kubelet's behaviour), side by side in one run:
//
//   - watch-file: a real file-watching program, Debian's inotifywait,
//     watching a visible file itself (it follows the symlink to the file in
//     the version directory, as fsnotify.Add(path) does) — from the start
//     of a put that changes the file to the watcher's first event;
//   - dotdata-reads: two readers that resolve ..data once and read every
//     file below it, during back-to-back writes — how many reads fail with
//     ENOENT per 100,000 (failed-per-100k) because the version they
//     resolved was removed under them.
//
// Run it with -benchtime 5x: each watch-file round with the default grace
// takes 5 s.
func BenchmarkReplacedGrace(b *testing.B) {
	roottest.Tools(b, map[string]string{"inotifywait": "inotify-tools"})
	for _, keep := range []string{"0s", "5s"} {
		b.Run("keep="+keep+"/watch-file", func(b *testing.B) {
			store := etcdStore(b)
			dir := benchDaemonWith(b, store, 10, "disk", benchExtras{mount: fmt.Sprintf("keep_replaced = %q\n", keep)})
			d := make([]time.Duration, 0, b.N)
			for i := range b.N {
				events, started := inotifywait(b, filepath.Join(dir, "key-00000"))
				<-started
				start := time.Now()
				if err := store.put(store.prefix+"key-00000", fmt.Sprintf("update %d", i)); err != nil {
					b.Fatal(err)
				}
				select {
				case <-events:
					d = append(d, time.Since(start))
				case <-time.After(waitTimeout):
					b.Fatal("inotifywait heard nothing")
				}
			}
			report(b, "put-to-event", d)
		})
		b.Run("keep="+keep+"/dotdata-reads", func(b *testing.B) {
			store := etcdStore(b)
			dir := benchDaemonWith(b, store, 10, "disk", benchExtras{mount: fmt.Sprintf("keep_replaced = %q\n", keep)})
			var reads, failures atomic.Int64
			stop := make(chan struct{})
			var wg sync.WaitGroup
			for range 2 {
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						default:
						}
						version, err := os.Readlink(filepath.Join(dir, projector.DataDirName))
						if err != nil {
							continue
						}
						for j := range 10 {
							_, err := os.ReadFile(filepath.Join(dir, version, fmt.Sprintf("key-%05d", j)))
							reads.Add(1)
							if errors.Is(err, fs.ErrNotExist) {
								failures.Add(1)
							}
						}
					}
				})
			}
			w := watchSwitches(b, dir)
			b.ResetTimer()
			for i := range b.N * 200 {
				var kv []string
				for j := range 10 {
					kv = append(kv, fmt.Sprintf("%skey-%05d", store.prefix, j), fmt.Sprintf("update %d", i))
				}
				store.seed(kv)
				w.wait(b)
			}
			b.StopTimer()
			close(stop)
			wg.Wait()
			b.ReportMetric(float64(reads.Load()), "reads")
			b.ReportMetric(float64(failures.Load())*100_000/float64(max(reads.Load(), 1)), "failed-per-100k")
		})
	}
}

// inotifywait runs Debian's inotifywait on path until its first event:
// started is closed once its watch is established, events receives when
// it reports one.
func inotifywait(b *testing.B, path string) (events, started <-chan struct{}) {
	b.Helper()
	cmd := exec.Command("inotifywait", "-e", "delete_self,attrib,modify,move_self", path)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	ev, st := make(chan struct{}), make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if strings.Contains(sc.Text(), "Watches established") {
				close(st)
				break
			}
		}
		for sc.Scan() {
		}
		_ = cmd.Wait()
		close(ev)
	}()
	b.Cleanup(func() { _ = cmd.Process.Kill() })
	return ev, st
}
