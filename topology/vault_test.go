package topology

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/kvmount/kvmount/internal/loadbalancer"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/internal/vaulttest"
)

// The Vault topology's settings: what its bars are measured against.
const (
	vaultPoll = time.Second
	// vaultBar is the bar: after Vault answers again, every mount
	// current and every due certificate issued within 2 × poll_interval +
	// 10 s.
	vaultBar = 2*vaultPoll + 10*time.Second
	// The AppRole token's TTL and maximum TTL, the certificates' validity
	// and the database credentials' lease, as the review ran them.
	tokenTTL, tokenMaxTTL = "20s", "60s"
	certTTL               = 30 * time.Second
	credsTTL, credsMaxTTL = "30s", "90s"
)

// redis is a Redis server (Debian's redis-server) on a loopback port,
// whose default user's password is redisAdmin: the database behind
// Vault's database secrets engine.
type redis struct {
	port int
}

const redisAdmin = "kvmount-test-admin"

func startRedis(t testing.TB) *redis {
	t.Helper()
	roottest.Tools(t, map[string]string{"redis-server": "redis-server", "redis-cli": "redis-tools"})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	logs := &testlog.Buffer{}
	cmd := exec.Command("redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--requirepass", redisAdmin, "--dir", t.TempDir())
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("redis logs:\n%s", logs)
		}
	})
	r := &redis{port: port}
	deadline := time.Now().Add(waitTimeout)
	for !r.login("default", redisAdmin) {
		if time.Now().After(deadline) {
			t.Fatalf("redis does not answer:\n%s", logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return r
}

// login reports whether user can log in with password and run PING.
func (r *redis) login(user, password string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "redis-cli", "-h", "127.0.0.1", "-p", strconv.Itoa(r.port), "--no-auth-warning",
		"--user", user, "--pass", password, "PING").CombinedOutput()
	return err == nil && strings.TrimSpace(string(out)) == "PONG"
}

// vaultTopology is a 3-node Raft cluster behind a plain round-robin
// load balancer, set up as the review ran it: KV v2 at secret/, AppRole
// for kvmount, a PKI role, and Redis credentials from the database
// secrets engine.
type vaultTopology struct {
	t       testing.TB
	cluster *vaulttest.Cluster
	lb      *loadbalancer.Balancer
	redis   *redis
	roleID  string
	secret  string
}

func newVaultTopology(t testing.TB) *vaultTopology {
	t.Helper()
	c := vaulttest.StartCluster(t, 3)
	var backends []string
	for _, n := range c.Nodes {
		backends = append(backends, n.Addr())
	}
	v := &vaultTopology{t: t, cluster: c, lb: loadbalancer.Start(t, backends, nil), redis: startRedis(t)}
	cl := c.Client(c.Active())
	write := func(path string, data map[string]any) *api.Secret {
		t.Helper()
		s, err := cl.Logical().Write(path, data)
		if err != nil {
			t.Fatalf("vault write %s: %v", path, err)
		}
		return s
	}
	write("sys/mounts/secret", map[string]any{"type": "kv", "options": map[string]any{"version": "2"}})
	write("sys/mounts/pki", map[string]any{"type": "pki", "config": map[string]any{"max_lease_ttl": "87600h"}})
	write("pki/root/generate/internal", map[string]any{"common_name": "example.com", "ttl": "8760h"})
	write("pki/roles/web", map[string]any{"allowed_domains": "example.com", "allow_subdomains": true, "max_ttl": "72h",
		"not_before_duration": "1s", "key_type": "ec", "key_bits": 256})
	write("sys/mounts/database", map[string]any{"type": "database"})
	write("database/config/redis", map[string]any{"plugin_name": "redis-database-plugin", "host": "127.0.0.1",
		"port": v.redis.port, "username": "default", "password": redisAdmin, "allowed_roles": "app"})
	write("database/roles/app", map[string]any{"db_name": "redis", "creation_statements": `["+@read", "+ping", "~*"]`,
		"default_ttl": credsTTL, "max_ttl": credsMaxTTL})
	write("sys/auth/approle", map[string]any{"type": "approle"})
	write("sys/policies/acl/kvmount", map[string]any{"policy": `path "secret/*" { capabilities = ["read", "list"] }
path "sys/internal/ui/mounts/*" { capabilities = ["read"] }
path "pki/issue/web" { capabilities = ["update"] }
path "database/creds/app" { capabilities = ["read"] }
path "sys/leases/renew" { capabilities = ["update"] }`})
	write("auth/approle/role/kvmount", map[string]any{"token_policies": "kvmount", "token_ttl": tokenTTL, "token_max_ttl": tokenMaxTTL})
	role, err := cl.Logical().Read("auth/approle/role/kvmount/role-id")
	if err != nil {
		t.Fatal(err)
	}
	v.roleID = role.Data["role_id"].(string)
	v.secret = write("auth/approle/role/kvmount/secret-id", nil).Data["secret_id"].(string)
	return v
}

// source returns a [sources.NAME] table of a vault source at address
// that logs in with kvmount's AppRole and polls every poll.
func (v *vaultTopology) source(name, address, dir string, poll time.Duration) string {
	roleFile := filepath.Join(dir, name+"-role-id")
	secretFile := filepath.Join(dir, name+"-secret-id")
	for f, content := range map[string]string{roleFile: v.roleID, secretFile: v.secret} {
		if err := os.WriteFile(f, []byte(content), 0o600); err != nil {
			v.t.Fatal(err)
		}
	}
	return fmt.Sprintf("[sources.%s]\ntype = \"vault\"\naddress = \"http://%s\"\npoll_interval = %q\n[sources.%s.approle]\nrole_id_file = %q\nsecret_id_file = %q\n",
		name, address, poll, name, roleFile, secretFile)
}

// writer writes secret/app/cfg with n and check equal, n counting up
// every 250 ms, to whichever node is active, until ctx is done; each
// acknowledged write goes into h.
func (v *vaultTopology) writer(ctx context.Context, h *history) {
	n := 0
	clients := map[string]*api.Client{}
	for ctx.Err() == nil {
		time.Sleep(250 * time.Millisecond)
		n++
		for _, node := range v.cluster.Nodes {
			cl := clients[node.ID]
			if cl == nil {
				cl = v.cluster.Client(node)
				cl.SetClientTimeout(time.Second)
				clients[node.ID] = cl
			}
			wctx, cancel := context.WithTimeout(ctx, time.Second)
			_, err := cl.KVv2("secret").Put(wctx, "app/cfg", map[string]any{"n": strconv.Itoa(n), "check": strconv.Itoa(n)})
			cancel()
			if err == nil {
				h.ack(n, time.Now())
				break
			}
		}
	}
}

// serving waits until a write through some node is acknowledged again,
// and returns when.
func (v *vaultTopology) serving(h *history, since time.Time) time.Time {
	v.t.Helper()
	before := h.lastAcked()
	deadline := time.Now().Add(waitTimeout)
	for {
		h.mu.Lock()
		var at time.Time
		if len(h.acked) > 0 && h.acked[len(h.acked)-1].n > before {
			at = h.acked[len(h.acked)-1].at
		}
		h.mu.Unlock()
		if !at.IsZero() && at.After(since) {
			return at
		}
		if time.Now().After(deadline) {
			v.t.Fatalf("vault does not acknowledge writes %v after the fault", waitTimeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// downtime records, until ctx is done, the windows in which node does
// not serve — a read through it fails or takes over a second: sealed,
// down, or a standby that cannot reach an active node — as outages of
// mount's source alone.
func (v *vaultTopology) downtime(ctx context.Context, h *history, node *vaulttest.Node, mount string) {
	cl := v.cluster.Client(node)
	cl.SetClientTimeout(time.Second)
	var from time.Time
	for ctx.Err() == nil {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := cl.KVv2("secret").Get(rctx, "app/cfg")
		cancel()
		up := err == nil
		switch {
		case !up && from.IsZero():
			from = time.Now()
		case up && !from.IsZero():
			h.outageOf(mount, node.ID+" down", from, time.Now())
			from = time.Time{}
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// spans returns times as spans of consecutive samples (at most gap
// apart), for the log.
func spans(times []time.Time, gap time.Duration) string {
	var out []string
	for i := 0; i < len(times); {
		j := i
		for j+1 < len(times) && times[j+1].Sub(times[j]) <= gap {
			j++
		}
		out = append(out, fmt.Sprintf("%s+%v", times[i].Format("15:04:05.000"), times[j].Sub(times[i]).Round(time.Millisecond)))
		i = j + 1
	}
	return strings.Join(out, " ")
}

// certs follows the certificate in dir: every 250 ms it reads the
// certificate and key of one version, checks they are a pair, and records
// their expiry; expired returns the times at which the mount held an
// expired certificate.
type certs struct {
	mu      sync.Mutex
	expired []time.Time
	serials map[string]bool
}

func (c *certs) watch(ctx context.Context, t testing.TB, dir string) {
	c.serials = map[string]bool{}
	for ctx.Err() == nil {
		time.Sleep(250 * time.Millisecond)
		target, err := os.Readlink(filepath.Join(dir, "..data"))
		if err != nil {
			continue
		}
		certPEM, err1 := os.ReadFile(filepath.Join(dir, target, "certificate"))
		keyPEM, err2 := os.ReadFile(filepath.Join(dir, target, "private_key"))
		if err1 != nil || err2 != nil {
			continue
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Errorf("certificate and key of %s are not a pair: %v", target, err)
			continue
		}
		now := time.Now()
		c.mu.Lock()
		c.serials[pair.Leaf.SerialNumber.String()] = true
		if now.After(pair.Leaf.NotAfter) {
			c.expired = append(c.expired, now)
		}
		c.mu.Unlock()
	}
}

// creds follows the database credentials in dir: every 250 ms it logs in
// to Redis with the username and password of one version, and records the
// times at which that failed.
type creds struct {
	mu      sync.Mutex
	refused []time.Time
	users   map[string]bool
}

func (c *creds) watch(ctx context.Context, r *redis, dir string) {
	c.users = map[string]bool{}
	for ctx.Err() == nil {
		time.Sleep(250 * time.Millisecond)
		target, err := os.Readlink(filepath.Join(dir, "..data"))
		if err != nil {
			continue
		}
		user, err1 := os.ReadFile(filepath.Join(dir, target, "username"))
		pass, err2 := os.ReadFile(filepath.Join(dir, target, "password"))
		if err1 != nil || err2 != nil {
			continue
		}
		ok := r.login(string(user), string(pass))
		c.mu.Lock()
		c.users[string(user)] = true
		if !ok && ctx.Err() == nil {
			c.refused = append(c.refused, time.Now())
		}
		c.mu.Unlock()
	}
}

// outside returns the times of at that lie outside every outage window
// and the bar after it.
func outside(at []time.Time, outages []window, bar time.Duration) []string {
	var out []string
	for _, a := range at {
		excused := false
		for _, o := range outages {
			if !a.Before(o.from) && !a.After(o.to.Add(bar)) {
				excused = true
			}
		}
		if !excused {
			out = append(out, a.Format("15:04:05.000"))
		}
	}
	return out
}

// TestVaultHACluster runs kvmount against Vault as it runs in production:
// three nodes with integrated storage (Raft) on 127.0.0.11–13, a plain
// round-robin TCP load balancer in front (source lb), and a second source
// pointed at one node (pinned); AppRole tokens of 20 s (60 s at most),
// KV v2 rewritten every 250 ms, 30 s certificates and Redis credentials
// under 30 s leases. The faults: the active node killed, stepped down,
// sealed, frozen; the pinned node sealed; the node holding kvmount's
// connections sealed while two serve; kvmount's tokens revoked; the
// whole cluster restarted; kvmount killed. Throughout: never a mixed
// version or a step backwards, every acknowledged write in the mounts
// within 2 × poll_interval + 10 s of Vault answering again (through a
// node sealed behind the load balancer, within that bar of the write),
// no certificate expired and no database login refused while Vault
// answered, and at most a few requests and new connections a second
// through the load balancer.
func TestVaultHACluster(tt *testing.T) {
	t := keepFailures(tt)
	roottest.Require(t)
	v := newVaultTopology(t)
	pinned := v.cluster.Nodes[0]
	d := newKvmountd(t, "")
	conf := v.source("lb", v.lb.Addr(), d.base, vaultPoll) + v.source("pinned", pinned.Addr(), d.base, vaultPoll) +
		d.tmpfsMount("app", "source = \"lb\"\nprefix = \"secret/app/\"") +
		d.tmpfsMount("pinned", "source = \"pinned\"\nprefix = \"secret/app/\"") +
		d.tmpfsMount("tls", fmt.Sprintf("source = \"lb\"\n[mount.pki]\nrole = \"pki/issue/web\"\ncommon_name = \"web.example.com\"\nttl = %q", certTTL)) +
		d.tmpfsMount("redis", "source = \"lb\"\nprefix = \"database/creds/app\"")
	if err := os.WriteFile(d.config, append(must(os.ReadFile(d.config)), conf...), 0o644); err != nil {
		t.Fatal(err)
	}

	h := newHistory()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	goAll := func(fs ...func()) {
		for _, f := range fs {
			wg.Add(1)
			go func() { defer wg.Done(); f() }()
		}
	}
	goAll(func() { v.writer(ctx, h) })
	v.serving(h, time.Time{})
	d.start()
	for _, m := range []string{"app", "pinned", "tls", "redis"} {
		d.waitState(m, "current", waitTimeout)
	}
	var cert certs
	var cred creds
	goAll(
		func() { h.read(ctx, t, "app", d.dir("app"), "cfg") },
		func() { h.read(ctx, t, "pinned", d.dir("pinned"), "cfg") },
		func() { cert.watch(ctx, t, d.dir("tls")) },
		func() { cred.watch(ctx, v.redis, d.dir("redis")) },
	)
	var st states
	goAll(func() { v.downtime(ctx, h, pinned, "pinned") }, func() { st.watch(ctx, d, "app", "pinned") })
	acceptedBefore := v.lb.Accepted()
	started := time.Now()

	// settle waits until the mount app holds the last acknowledged write.
	settle := func(what string) {
		t.Helper()
		h.waitHeld(t, what, []string{"app"}, &st)
	}
	// outage runs fault, waits until Vault answers again, records the
	// window, then runs heal (when not nil) and settles.
	outage := func(what string, fault, heal func()) {
		t.Helper()
		from := time.Now()
		fault()
		to := v.serving(h, from)
		h.outage(what, from, to)
		if heal != nil {
			heal()
		}
		settle(what)
		caughtUp := time.Now()
		stale := "not reported stale"
		if at, ok := st.first("app", "stale", from); ok && at.Before(caughtUp) {
			stale = fmt.Sprintf("stale after %v", at.Sub(from).Round(time.Millisecond))
		}
		t.Logf("%s: Vault answered again after %v; app %s, caught up %v after Vault answered", what,
			to.Sub(from).Round(time.Millisecond), stale, caughtUp.Sub(to).Round(time.Millisecond))
	}

	settle("start")
	// The active node killed, then started again (it rejoins as a standby).
	var killed *vaulttest.Node
	outage("active killed", func() { killed = v.cluster.Active(); killed.Kill() }, nil)
	killed.Restart()
	// The active node steps down.
	outage("step-down", func() { v.cluster.Active().StepDown() }, nil)
	// The active node sealed, then unsealed.
	var sealed *vaulttest.Node
	outage("active sealed", func() { sealed = v.cluster.Active(); sealed.Seal() }, nil)
	sealed.Unseal()
	sealed.WaitHealth(vaulttest.HealthActive, vaulttest.HealthStandby)
	// The active node frozen for 10 s.
	var frozen *vaulttest.Node
	var thawed <-chan time.Time
	outage("active frozen", func() {
		frozen = v.cluster.Active()
		frozen.Freeze()
		thawed = time.After(10 * time.Second)
	}, nil)
	<-thawed
	frozen.Thaw()
	frozen.WaitHealth(vaulttest.HealthActive, vaulttest.HealthStandby)

	// The pinned node sealed: its mount is reported stale within 5 s, the
	// others carry on; unsealed, it is current within the bar.
	from := time.Now()
	pinned.Seal()
	if took := d.waitState("pinned", "stale", 10*time.Second); time.Since(from) > 5*time.Second {
		t.Errorf("the pinned mount was reported stale %v after its node was sealed; want within 5 s", time.Since(from).Round(time.Millisecond))
	} else {
		t.Logf("pinned node sealed: stale after %v", took.Round(time.Millisecond))
	}
	time.Sleep(3 * time.Second)
	pinned.Unseal()
	pinned.WaitHealth(vaulttest.HealthActive, vaulttest.HealthStandby)
	t.Logf("pinned node unsealed: current after %v", d.waitState("pinned", "current", vaultBar).Round(time.Millisecond))

	// The node holding most of kvmount's connections through the load
	// balancer sealed while two serve: not an outage of Vault, so every
	// write must reach app within the bar as always.
	open := v.lb.Open()
	busiest := slices.Index(open, slices.Max(open))
	behind := v.cluster.Nodes[busiest]
	t.Logf("kvmount's connections per node: %v; sealing %s", open, behind.ID)
	behind.Seal()
	if behind.Health() == vaulttest.HealthSealed && v.cluster.Active() == behind {
		t.Fatal("the sealed node is still active")
	}
	time.Sleep(5 * time.Second)
	settle("the node behind kvmount's connections sealed")
	behind.Unseal()
	behind.WaitHealth(vaulttest.HealthActive, vaulttest.HealthStandby)

	// kvmount's tokens revoked: it logs in again; the database lease
	// ended with its token, so the credentials are read again.
	revoked := time.Now()
	revokeAppRoleTokens(t, v.cluster)
	h.outage("tokens revoked", revoked, revoked)
	time.Sleep(3 * time.Second)
	settle("tokens revoked")

	// The whole cluster restarted.
	outage("cluster restarted", func() {
		for _, n := range v.cluster.Nodes {
			n.Kill()
		}
		for _, n := range v.cluster.Nodes {
			n.Start()
		}
		for _, n := range v.cluster.Nodes {
			n.Unseal()
		}
	}, nil)

	// kvmount killed and started again: it adopts its mounts.
	killedAt := time.Now()
	d.kill()
	h.outage("kvmount killed", killedAt, killedAt.Add(time.Second))
	d.start()
	for _, m := range []string{"app", "pinned", "tls", "redis"} {
		d.waitState(m, "current", vaultBar)
	}
	settle("kvmount restarted")
	time.Sleep(vaultBar)

	elapsed := time.Since(started)
	cancel()
	wg.Wait()
	t.Logf("states:\n%s", &st)

	late, longest := h.lags("app", vaultBar)
	t.Logf("app: %d writes, longest lag %v", len(h.acked), longest.Round(time.Millisecond))
	if len(late) > 0 {
		t.Errorf("app: %d writes seen later than %v after Vault answered: %s", len(late), vaultBar, strings.Join(late[:min(len(late), 10)], "; "))
	}
	late, longest = h.lags("pinned", vaultBar)
	t.Logf("pinned: longest lag %v", longest.Round(time.Millisecond))
	if len(late) > 0 {
		t.Errorf("pinned: %d writes seen later than %v: %s", len(late), vaultBar, strings.Join(late[:min(len(late), 10)], "; "))
	}
	if bad := outside(cert.expired, h.outagesOf("tls"), vaultBar); len(bad) > 0 {
		t.Errorf("an expired certificate was in the mount while Vault answered, at %v", bad)
	}
	t.Logf("certificates seen: %d", len(cert.serials))
	if bad := outside(cred.refused, h.outagesOf("redis"), vaultBar); len(bad) > 0 {
		t.Errorf("Redis refused the mount's credentials while Vault answered, at %v", bad)
	}
	t.Logf("database users seen: %d, logins refused: %d (%s)", len(cred.users), len(cred.refused), spans(cred.refused, time.Second))
	for _, o := range h.outagesOf("pinned") {
		t.Logf("outage %s %s: %s+%v", o.mount, o.what, o.from.Format("15:04:05.000"), o.to.Sub(o.from).Round(time.Millisecond))
	}
	reqs := v.lb.Requests()
	var peak int
	for s := started; s.Before(started.Add(elapsed)); s = s.Add(time.Second) {
		peak = max(peak, count(reqs, s, s.Add(time.Second)))
	}
	mean := float64(count(reqs, started, started.Add(elapsed))) / elapsed.Seconds()
	t.Logf("requests through the load balancer: %.1f/s, %d in the busiest second; reads of app: %d, of pinned: %d",
		mean, peak, len(h.reads["app"]), len(h.reads["pinned"]))
	if peak > 20 || mean > 8 {
		t.Errorf("%.1f requests a second through the load balancer, %d in the busiest second; want at most 8 and 20", mean, peak)
	}
	conns := v.lb.Accepted() - acceptedBefore
	perSecond := float64(conns) / elapsed.Seconds()
	t.Logf("connections through the load balancer: %d in %v (%.2f/s)", conns, elapsed.Round(time.Second), perSecond)
	if perSecond > 5 {
		t.Errorf("%.1f new connections a second through the load balancer; want at most 5", perSecond)
	}
	// Tokens live 60 s at most: only one that reached it may be replaced
	// for its maximum TTL, once per source.
	if c := d.logs.Count("replacing the vault token", "maximum TTL"); float64(c) > 2*(elapsed.Seconds()/60+1) {
		t.Errorf("%d tokens replaced for their maximum TTL in %v", c, elapsed.Round(time.Second))
	}
}

// revokeAppRoleTokens revokes every token of the AppRole auth method
// (kvmount's), by accessor, with the root token.
func revokeAppRoleTokens(t testing.TB, c *vaulttest.Cluster) {
	t.Helper()
	cl := c.Client(c.Active())
	list, err := cl.Logical().List("auth/token/accessors")
	if err != nil {
		t.Fatal(err)
	}
	keys, _ := list.Data["keys"].([]any)
	n := 0
	for _, k := range keys {
		acc, _ := k.(string)
		look, err := cl.Auth().Token().LookupAccessor(acc)
		if err != nil || look == nil {
			continue
		}
		if path, _ := look.Data["path"].(string); !strings.HasPrefix(path, "auth/approle/") {
			continue
		}
		if err := cl.Auth().Token().RevokeAccessor(acc); err != nil {
			t.Fatal(err)
		}
		n++
	}
	if n == 0 {
		t.Fatal("no AppRole token to revoke")
	}
	t.Logf("revoked %d AppRole tokens", n)
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}
