package daemon

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// BenchmarkStoreBeyondLimits measures what the second review's ninth
// finding measured: the memory of the kvmount binary whose one mount is
// limited to 5 files and 1 MiB (max_files, max_mount_size) when its prefix
// in etcd holds 60 values of 1.4 MB — at the first read, and at a restart
// that reads them all again. It reports the peak RSS (VmHWM) and the RSS
// once settled, in MiB, of the monitor and of its worker; with KVMOUNT_BENCH_BASELINE, the baseline binary
// beside this tree's in the same run.
func BenchmarkStoreBeyondLimits(b *testing.B) {
	bins := []struct{ name, bin string }{{"head", ""}}
	if base := os.Getenv("KVMOUNT_BENCH_BASELINE"); base != "" {
		bins = append([]struct{ name, bin string }{{"baseline", base}}, bins...)
	}
	for _, bc := range bins {
		b.Run(bc.name, func(b *testing.B) {
			bin := bc.bin
			if bin == "" {
				bin = buildKvmount(b)
			}
			for range b.N {
				store := etcdStore(b)
				big := strings.Repeat("x", 1_400_000)
				for i := range 60 {
					if err := store.put(fmt.Sprintf("%sk%02d", store.prefix, i), big); err != nil {
						b.Fatal(err)
					}
				}
				base := b.TempDir()
				cfg := fmt.Sprintf("state_dir = %q\n[admin]\naddress = \"\"\nsocket = \"\"\n[sources.main]\n%s[[mount]]\nname = \"bench\"\ndir = %q\nsource = \"main\"\nprefix = %q\nmax_files = 5\nmax_mount_size = \"1MiB\"\n",
					filepath.Join(base, "state"), store.source, filepath.Join(base, "mnt"), store.prefix)
				path := filepath.Join(base, "kvmount.toml")
				if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
					b.Fatal(err)
				}
				for _, phase := range []string{"first", "restart"} {
					cmd := exec.Command(bin, "run", "-config", path)
					cmd.Stderr = io.Discard
					if err := cmd.Start(); err != nil {
						b.Fatal(err)
					}
					time.Sleep(3 * time.Second) // reads, refusals and retries settle
					b.ReportMetric(float64(procStatusKB(b, cmd.Process.Pid, "VmHWM:"))/1024, phase+"-peak-rss-MiB")
					b.ReportMetric(float64(procStatusKB(b, cmd.Process.Pid, "VmRSS:"))/1024, phase+"-rss-MiB")
					// Since issue 28 the worker reads the store: its peak
					// is where a read of the values would show.
					var peak, rss int64
					for _, child := range childPIDs(b, cmd.Process.Pid) {
						peak += procStatusKB(b, child, "VmHWM:")
						rss += procStatusKB(b, child, "VmRSS:")
					}
					b.ReportMetric(float64(peak)/1024, phase+"-peak-rss-worker-MiB")
					b.ReportMetric(float64(rss)/1024, phase+"-rss-worker-MiB")
					_ = cmd.Process.Signal(syscall.SIGTERM)
					_ = cmd.Wait()
				}
			}
		})
	}
}

// procStatusKB returns the field (such as "VmHWM:") of /proc/pid/status,
// in kB.
func procStatusKB(b *testing.B, pid int, field string) int64 {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, field); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb
		}
	}
	b.Fatalf("no %s in /proc/%d/status", field, pid)
	return 0
}
