package etcd

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/source"
)

// BenchmarkWatchGrouping measures what 1,000 prefixes of 100 keys cost an
// etcd member running as its own process (issue 37): grouped, as kvmount
// follows them now (a handful of watches, source.Partition), and one watch
// per prefix, as it did before (forced here by taking every prefix for one
// that authorization refused a group for). It reports the time from the
// first Follow to every prefix's first snapshot (first-s), the member's
// watchers (etcd_debugging_mvcc_watcher_total), the range requests the
// start made (etcd_mvcc_range_total), the member's CPU during the start
// (start-cpu-ms) and per second at rest over 10 s (idle-cpu-us/s), and its
// resident memory at rest (member-rss-MiB). b.N is ignored: one start per
// run (-benchtime 1x).
func BenchmarkWatchGrouping(b *testing.B) {
	for _, mode := range []string{"grouped", "per-prefix"} {
		b.Run(mode, func(b *testing.B) { benchGrouping(b, mode == "per-prefix") })
	}
}

func benchGrouping(b *testing.B, perPrefix bool) {
	const prefixes, keys, window = 1000, 100, 10 * time.Second
	cl := etcdtest.StartCluster(b, 1)
	m := cl.Members[0]
	cli := cl.Client(b)
	value := strings.Repeat("v", 75)
	for p := range prefixes {
		ops := make([]clientv3.Op, 0, keys)
		for k := range keys {
			ops = append(ops, clientv3.OpPut(fmt.Sprintf("/scale/m%04d/key-%03d", p, k), value))
		}
		if _, err := cli.Txn(context.Background()).Then(ops...).Commit(); err != nil {
			b.Fatal(err)
		}
	}
	metric := func(name string) float64 {
		resp, err := http.Get(m.ClientURL + "/metrics")
		if err != nil {
			b.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		var sum float64
		for _, line := range regexp.MustCompile(`(?m)^`+name+`(\{[^}]*\})? ([0-9.e+]+)$`).FindAllSubmatch(body, -1) {
			v, _ := strconv.ParseFloat(string(line[2]), 64)
			sum += v
		}
		return sum
	}
	cpu := func() time.Duration {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", m.Pid()))
		if err != nil {
			b.Fatal(err)
		}
		f := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+2:]))
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		return time.Duration(ut+st) * time.Second / 100 // USER_HZ
	}
	rss := func() float64 {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", m.Pid()))
		if err != nil {
			b.Fatal(err)
		}
		for line := range strings.SplitSeq(string(data), "\n") {
			if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
				return kb / 1024
			}
		}
		return 0
	}
	src, err := New("main", &Config{Endpoints: cl.Endpoints(), DialTimeout: 5 * time.Second, ChangeDetection: Watch}, sourcetest.Discard)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { src.Close() })
	if perPrefix {
		src.refusedPrefixes = []string{""}
	}
	ranges0, cpu0, t0 := metric("etcd_mvcc_range_total"), cpu(), time.Now()
	b.ResetTimer()
	recs := make([]*sourcetest.Recorder, prefixes)
	for p := range prefixes {
		recs[p] = sourcetest.Follow(b, src, fmt.Sprintf("/scale/m%04d/", p))
	}
	for _, rec := range recs {
		rec.WaitFor(b, "a first snapshot", func(snaps []source.Snapshot, _ error) bool { return len(snaps) > 0 })
	}
	first := time.Since(t0)
	b.StopTimer()
	startCPU, ranges := cpu()-cpu0, metric("etcd_mvcc_range_total")-ranges0
	time.Sleep(2 * time.Second)
	c0 := cpu()
	time.Sleep(window)
	idle := cpu() - c0
	b.ReportMetric(first.Seconds(), "first-s")
	b.ReportMetric(metric("etcd_debugging_mvcc_watcher_total"), "watchers")
	b.ReportMetric(ranges, "ranges")
	b.ReportMetric(float64(startCPU.Milliseconds()), "start-cpu-ms")
	b.ReportMetric(float64(idle.Microseconds())/window.Seconds(), "idle-cpu-us/s")
	b.ReportMetric(rss(), "member-rss-MiB")
}
