package topology

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/loadbalancer"
	"github.com/kvmount/kvmount/internal/roottest"
)

// cpuTime returns the CPU time (user + system) process pid has used.
func cpuTime(b *testing.B, pid int) time.Duration {
	b.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Fatal(err)
	}
	// The fields after the command's closing parenthesis: utime and
	// stime are the 12th and 13th, in clock ticks (USER_HZ, 100).
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * 10 * time.Millisecond
}

// BenchmarkConsulProbe measures what the liveness probe costs. A kvmount
// daemon with one source (consistency default) and one mount reads a
// Consul cluster (3 servers, a client agent) through a counting TCP
// proxy: its requests a second at rest, over 60 s. Then a load of stale
// single-key reads — the probe's request — at 1,000 a second for 30 s
// through the client agent, as 1,000 daemons behind their agents would
// send: the CPU the servers and the agent spend on it, beside the same 30
// s without it. BENCHMARKS.md scales it to 10,000 daemons.
//
//	KVMOUNT_CONSUL=$(scripts/consul-agent.sh) go test -run '^$' -bench BenchmarkConsulProbe -benchtime 1x ./topology
func BenchmarkConsulProbe(b *testing.B) {
	roottest.Require(b)
	for range b.N {
		c := consultest.StartCluster(b, 3)
		lb := loadbalancer.Start(b, []string{c.Client.Addr()}, nil)
		d := newKvmountd(b, fmt.Sprintf("[sources.main]\ntype = \"consul\"\naddress = \"http://%s\"\n", lb.Addr()))
		conf := d.tmpfsMount("app", "source = \"main\"\nprefix = \"app/\"")
		if err := os.WriteFile(d.config, append(must(os.ReadFile(d.config)), conf...), 0o644); err != nil {
			b.Fatal(err)
		}
		if _, err := c.Client.APIClient().KV().Put(&api.KVPair{Key: "app/a", Value: []byte("1")}, nil); err != nil {
			b.Fatal(err)
		}
		d.start()
		d.waitState("app", "current", waitTimeout)
		time.Sleep(5 * time.Second)
		const rest = 60 * time.Second
		from := time.Now()
		time.Sleep(rest)
		b.ReportMetric(float64(count(lb.Requests(), from, from.Add(rest)))/rest.Seconds(), "req/s-per-daemon")

		const span, rate = 30 * time.Second, 1000
		pids := func() []int {
			var out []int
			for _, s := range c.Servers {
				out = append(out, s.PID())
			}
			return append(out, c.Client.PID())
		}()
		usage := func(run func()) []time.Duration {
			before := make([]time.Duration, len(pids))
			for i, p := range pids {
				before[i] = cpuTime(b, p)
			}
			run()
			out := make([]time.Duration, len(pids))
			for i, p := range pids {
				out[i] = cpuTime(b, p) - before[i]
			}
			return out
		}
		idle := usage(func() { time.Sleep(span) })
		cl := c.Client.APIClient()
		loaded := usage(func() {
			ctx, cancel := context.WithTimeout(context.Background(), span)
			defer cancel()
			tick := time.NewTicker(time.Second / rate)
			defer tick.Stop()
			sem := make(chan struct{}, 64)
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				select {
				case sem <- struct{}{}:
				default:
					continue // more than 64 in flight: the agent is behind
				}
				go func() {
					defer func() { <-sem }()
					_, _, _ = cl.KV().Get("app/", (&api.QueryOptions{AllowStale: true}).WithContext(ctx))
				}()
			}
		})
		var servers time.Duration
		for i := range c.Servers {
			servers += loaded[i] - idle[i]
		}
		agent := loaded[len(pids)-1] - idle[len(pids)-1]
		probes := float64(rate) * span.Seconds()
		b.ReportMetric(float64(servers.Microseconds())/probes, "server-cpu-us/probe")
		b.ReportMetric(float64(agent.Microseconds())/probes, "agent-cpu-us/probe")
		b.ReportMetric(float64(servers)/float64(span)/rate*10_000, "server-cores-for-10k")
	}
}

// BenchmarkConsulModes measures what each consistency mode trades: three
// sources (default, stale, consistent) on one client agent, each with a
// mount of app/, and 200 writes through the leader, one every 100 ms;
// for each mode, the time from the write's acknowledgement until its mount
// holds it (p50, p99), both when the client agent forwards to the leader
// and when it forwards to a follower.
//
//	KVMOUNT_CONSUL=$(scripts/consul-agent.sh) go test -run '^$' -bench BenchmarkConsulModes -benchtime 1x ./topology
func BenchmarkConsulModes(b *testing.B) {
	roottest.Require(b)
	for range b.N {
		c := consultest.StartCluster(b, 3)
		d := newKvmountd(b, "")
		var conf strings.Builder
		for _, m := range consulModes {
			fmt.Fprintf(&conf, "[sources.%s]\ntype = \"consul\"\naddress = \"http://%s\"\nconsistency = %q\n", m, c.Client.Addr(), m)
			conf.WriteString(d.tmpfsMount(m, fmt.Sprintf("source = %q\nprefix = \"app/\"", m)))
		}
		if err := os.WriteFile(d.config, append(must(os.ReadFile(d.config)), conf.String()...), 0o644); err != nil {
			b.Fatal(err)
		}
		leader := c.WaitLeader()
		cl := leader.APIClient()
		put := func(v string) time.Time {
			if _, err := cl.KV().Put(&api.KVPair{Key: "app/v", Value: []byte(v)}, nil); err != nil {
				b.Fatal(err)
			}
			return time.Now()
		}
		put("0")
		d.start()
		for _, m := range consulModes {
			d.waitState(m, "current", waitTimeout)
		}
		forwards := c.Forwarding()
		where := "follower"
		if slices.Contains(forwards, leader) {
			where = "leader"
		}
		if len(forwards) != 1 {
			where = "mixed"
		}
		lat := map[string][]time.Duration{}
		for i := 1; i <= 200; i++ {
			v := strconv.Itoa(i)
			acked := put(v)
			seen := map[string]bool{}
			deadline := time.Now().Add(waitTimeout)
			for len(seen) < len(consulModes) {
				for _, m := range consulModes {
					if seen[m] {
						continue
					}
					if got, err := os.ReadFile(filepath.Join(d.dir(m), "v")); err == nil && string(got) == v {
						seen[m] = true
						lat[m] = append(lat[m], time.Since(acked))
					}
				}
				if time.Now().After(deadline) {
					b.Fatalf("not every mode held %s: %v", v, seen)
				}
				time.Sleep(200 * time.Microsecond)
			}
			time.Sleep(100 * time.Millisecond)
		}
		for _, m := range consulModes {
			l := lat[m]
			slices.Sort(l)
			b.ReportMetric(float64(l[len(l)/2].Microseconds())/1000, m+"-p50-ms-agent-to-"+where)
			b.ReportMetric(float64(l[len(l)*99/100].Microseconds())/1000, m+"-p99-ms-agent-to-"+where)
		}
	}
}
