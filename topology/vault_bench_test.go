package topology

import (
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
)

// BenchmarkVaultRequests measures what one daemon asks of a Vault HA
// cluster through its load balancer (TestVaultHACluster's topology), as
// the review measured it: a KV folder of 4 secrets polled every 2 s, a
// 30 s certificate, Redis credentials under a 30 s lease and an AppRole
// token of 20 s. It reports the requests a second at rest (over 60 s),
// in the 20 s after the active node is killed, and while the whole
// cluster is restarted and left sealed for 30 s: their mean, the busiest
// second, and the connections opened a second. BENCHMARKS.md multiplies
// them by 10,000 daemons.
//
//	KVMOUNT_VAULT=$(scripts/vault-server.sh) go test -run '^$' -bench BenchmarkVaultRequests -benchtime 1x ./topology
func BenchmarkVaultRequests(b *testing.B) {
	roottest.Require(b)
	for range b.N {
		vaultRequests(b)
	}
}

func vaultRequests(b *testing.B) {
	v := newVaultTopology(b)
	for i := range 4 {
		if _, err := v.cluster.Client(v.cluster.Active()).KVv2("secret").Put(b.Context(), fmt.Sprintf("app/s%d", i),
			map[string]any{"user": "u", "password": fmt.Sprint("p", i)}); err != nil {
			b.Fatal(err)
		}
	}
	d := newKvmountd(b, "")
	conf := v.source("lb", v.lb.Addr(), d.base, 2*time.Second) +
		d.tmpfsMount("app", "source = \"lb\"\nprefix = \"secret/app/\"") +
		d.tmpfsMount("tls", fmt.Sprintf("source = \"lb\"\n[mount.pki]\nrole = \"pki/issue/web\"\ncommon_name = \"web.example.com\"\nttl = %q", certTTL)) +
		d.tmpfsMount("redis", "source = \"lb\"\nprefix = \"database/creds/app\"")
	if err := os.WriteFile(d.config, append(must(os.ReadFile(d.config)), conf...), 0o644); err != nil {
		b.Fatal(err)
	}
	d.start()
	for _, m := range []string{"app", "tls", "redis"} {
		d.waitState(m, "current", waitTimeout)
	}
	time.Sleep(5 * time.Second)

	const rest, after = 60 * time.Second, 20 * time.Second
	from := time.Now()
	time.Sleep(rest)
	atRest := count(v.lb.Requests(), from, from.Add(rest))
	b.ReportMetric(float64(atRest)/rest.Seconds(), "req/s-at-rest")

	// The active node killed: a standby takes over within seconds.
	accepted := v.lb.Accepted()
	from = time.Now()
	active := v.cluster.Active()
	active.Kill()
	time.Sleep(after)
	report(b, "failover", v.lb.Requests(), from, after, v.lb.Accepted()-accepted)
	active.Restart()
	time.Sleep(5 * time.Second)

	// The whole cluster restarted and left sealed for 30 s, as an
	// upgrade that waits for its operators' unseal keys: every token and
	// lease renewal falls due while every node answers 503.
	const sealed = 30 * time.Second
	for _, n := range v.cluster.Nodes {
		n.Kill()
	}
	accepted = v.lb.Accepted()
	from = time.Now()
	for _, n := range v.cluster.Nodes {
		n.Start()
	}
	time.Sleep(sealed - time.Since(from))
	report(b, "sealed", v.lb.Requests(), from, sealed, v.lb.Accepted()-accepted)
	for _, n := range v.cluster.Nodes {
		n.Unseal()
	}
	v.cluster.Active()
}

// report reports the requests a second in [from, from+d), the busiest
// second, and the connections opened a second, as metrics named after
// what.
func report(b *testing.B, what string, reqs []time.Time, from time.Time, d time.Duration, conns int) {
	var busiest int
	for s := from; s.Before(from.Add(d)); s = s.Add(time.Second) {
		busiest = max(busiest, count(reqs, s, s.Add(time.Second)))
	}
	b.ReportMetric(float64(count(reqs, from, from.Add(d)))/d.Seconds(), "req/s-"+what)
	b.ReportMetric(float64(busiest), "req/s-"+what+"-peak")
	b.ReportMetric(float64(conns)/d.Seconds(), "conn/s-"+what)
}

// count returns how many of times lie in [from, to).
func count(times []time.Time, from, to time.Time) int {
	i, _ := slices.BinarySearchFunc(times, from, func(a, b time.Time) int { return a.Compare(b) })
	j, _ := slices.BinarySearchFunc(times, to, func(a, b time.Time) int { return a.Compare(b) })
	return j - i
}
