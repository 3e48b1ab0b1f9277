package daemon

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// BenchmarkWorkersPerDomain measures what a worker per trust domain
// costs (issue 36): a daemon of `sources` etcd sources and a mount of 10
// keys on each, its sources in domains of their own (one worker each)
// and, side by side, joined into one domain by a mount that reads them
// all (one worker). It reports the time from the start to every mount
// projected (start-ms), the workers, and the memory at rest of the
// monitor and its workers together (the sum of their PSS, pss-MiB) and of
// each worker (pss-worker-MiB, their mean), 5 s after the projection.
// With $KVMOUNT_BENCH_REST set, it measures that long after instead, and
// reports the mean and the peak of the PSS sampled every 5 s until then
// (pss-rest-mean-MiB, pss-rest-max-MiB). With $KVMOUNT_BENCH_BASELINE set
// (see BenchmarkPutToFile), that binary runs too, right before this
// tree's in every iteration, and its figures are prefixed "baseline-".
func BenchmarkWorkersPerDomain(b *testing.B) {
	for _, sources := range []int{1, 4, 8} {
		for _, layout := range []string{"own", "joined"} {
			if sources == 1 && layout == "joined" {
				continue
			}
			b.Run(fmt.Sprintf("sources=%d/domains=%s", sources, layout), func(b *testing.B) {
				benchDomains(b, sources, layout == "joined")
			})
		}
	}
}

// domainsRun is what benchDomains sums for one binary over its iterations.
type domainsRun struct {
	start          time.Duration
	pss, workerPSS int64
	workers        int
	// restMean and restPeak sum each run's mean and peak PSS over its
	// rest (KVMOUNT_BENCH_REST), in bytes.
	restMean, restPeak int64
}

// domainsBinary is a binary benchDomains runs, and the prefix of its
// figures.
type domainsBinary struct{ prefix, path string }

func benchDomains(b *testing.B, sources int, joined bool) {
	bins := []domainsBinary{{"", buildKvmount(b)}}
	if baseline := os.Getenv("KVMOUNT_BENCH_BASELINE"); baseline != "" {
		bins = append([]domainsBinary{{"baseline-", baseline}}, bins...)
	}
	store := etcdStore(b)
	for s := range sources {
		var kv []string
		for k := range 10 {
			kv = append(kv, fmt.Sprintf("/dom/s%d/key-%d", s, k), "value")
		}
		store.seed(kv)
	}
	runs := make([]domainsRun, len(bins))
	for range b.N {
		for i, bin := range bins {
			runDomains(b, bin.path, store, sources, joined, &runs[i])
		}
	}
	n := float64(b.N)
	for i, bin := range bins {
		r := runs[i]
		b.ReportMetric(r.start.Seconds()*1000/n, bin.prefix+"start-ms")
		b.ReportMetric(float64(r.workers), bin.prefix+"workers")
		b.ReportMetric(float64(r.pss)/n/(1<<20), bin.prefix+"pss-MiB")
		b.ReportMetric(float64(r.workerPSS)/n/(1<<20), bin.prefix+"pss-worker-MiB")
		if os.Getenv("KVMOUNT_BENCH_REST") != "" {
			b.ReportMetric(float64(r.restMean)/n/(1<<20), bin.prefix+"pss-rest-mean-MiB")
			b.ReportMetric(float64(r.restPeak)/n/(1<<20), bin.prefix+"pss-rest-max-MiB")
		}
	}
}

// runDomains runs bin once with a daemon of sources sources (joined or
// not, see benchDomains) and adds its figures to r.
func runDomains(b *testing.B, bin string, store benchStore, sources int, joined bool, r *domainsRun) {
	base := b.TempDir()
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "state_dir = %q\nresync_interval = \"1h\"\n%s", filepath.Join(base, "state"), noAdmin(b, bin))
	for s := range sources {
		fmt.Fprintf(&cfg, "[sources.s%d]\n%s", s, store.source)
	}
	for s := range sources {
		fmt.Fprintf(&cfg, "[[mount]]\nname = \"m%d\"\ndir = %q\nsource = \"s%d\"\nprefix = \"/dom/s%d/\"\n", s, filepath.Join(base, "mnt", fmt.Sprintf("m%d", s)), s, s)
	}
	if joined {
		fmt.Fprintf(&cfg, "[[mount]]\nname = \"all\"\ndir = %q\n", filepath.Join(base, "mnt", "all"))
		for s := range sources {
			fmt.Fprintf(&cfg, "  [[mount.projections]]\n  source = \"s%d\"\n  prefix = \"/dom/s%d/\"\n  items = [{ key = \"key-0\", path = \"s%d\" }]\n", s, s, s)
		}
	}
	configPath := filepath.Join(base, "kvmount.toml")
	if err := os.WriteFile(configPath, []byte(cfg.String()), 0o644); err != nil {
		b.Fatal(err)
	}
	evictBinary(b, bin)
	t0 := time.Now()
	cmd := exec.Command(bin, "run", "-config", configPath)
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	for s := sources - 1; s >= 0; {
		if _, err := os.Stat(filepath.Join(base, "mnt", fmt.Sprintf("m%d", s), "key-9")); err == nil {
			s--
			continue
		}
		if time.Since(t0) > time.Minute {
			b.Fatalf("mount m%d never projected", s)
		}
		time.Sleep(time.Millisecond)
	}
	projected := time.Now()
	r.start += projected.Sub(t0)
	// At rest: past the first garbage collections; with
	// $KVMOUNT_BENCH_REST set, that long after the start instead (150s:
	// past the runtime's first periodic collection, 2 minutes in, which
	// maps the collector's code and tables again).
	// Meanwhile, every 5 s from 5 s on, the PSS is sampled: its mean and
	// its peak over the rest (pss-rest-mean-MiB, pss-rest-max-MiB), which
	// the runtime's periodic collections move.
	rest := 5 * time.Second
	if d, err := time.ParseDuration(os.Getenv("KVMOUNT_BENCH_REST")); err == nil && d > 0 {
		rest = d
	}
	measure := func() (total, worker int64, workers int) {
		children := childPIDs(b, cmd.Process.Pid)
		total = processMemory(b, cmd.Process.Pid)["Pss"]
		var own int64
		for _, c := range children {
			p := processMemory(b, c)["Pss"]
			total += p
			own += p
		}
		return total, own / int64(max(len(children), 1)), len(children)
	}
	const sampleEvery = 5 * time.Second
	var sum, peak, samples int64
	for at := sampleEvery; at < rest; at += sampleEvery {
		time.Sleep(time.Until(projected.Add(at)))
		p, _, _ := measure()
		sum, peak, samples = sum+p, max(peak, p), samples+1
	}
	time.Sleep(time.Until(projected.Add(rest)))
	total, worker, workers := measure()
	sum, peak, samples = sum+total, max(peak, total), samples+1
	r.pss += total
	r.workerPSS += worker
	r.workers = workers
	r.restMean += sum / samples
	r.restPeak += peak
	_ = cmd.Process.Signal(syscall.SIGTERM)
	_ = cmd.Wait()
}
