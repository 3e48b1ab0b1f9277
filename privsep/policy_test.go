package privsep

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/source/consul"
	"github.com/kvmount/kvmount/source/etcd"
	sourcehttp "github.com/kvmount/kvmount/source/http"
	"github.com/kvmount/kvmount/source/vault"
)

var kinds = map[string]config.SourceDecoder{"etcd": etcd.Decode, "consul": consul.Decode, "http": sourcehttp.Decode, "vault": vault.Decode}

// parseConfig parses a configuration of sources only.
func parseConfig(t *testing.T, text string) *config.Config {
	t.Helper()
	cfg, err := config.Parse("k.toml", []byte(text), kinds)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// TestPolicyFor: the worker's ports are those of every store and webhook
// URL, by scheme where none is given, with DNS where a URL names a host; a
// unix endpoint is a socket.
func TestPolicyFor(t *testing.T) {
	token := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(token, []byte("t"), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := PolicyFor(parseConfig(t, fmt.Sprintf(`
[sources.main]
type = "etcd"
endpoints = ["http://localhost:2379", "unix:///run/etcd/etcd.sock"]
[sources.kv]
type = "consul"
address = "http://127.0.0.1:8500"
[sources.web]
type = "http"
url = "https://config.example.com/app.json"
[sources.vault]
type = "vault"
address = "https://vault.example:8200"
token_file = %q
`, token)))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(p.ConnectTCP)
	if want := []uint16{53, 443, 2379, 8200, 8500}; !slices.Equal(p.ConnectTCP, want) {
		t.Errorf("TCP ports %v; want %v", p.ConnectTCP, want)
	}
	if !slices.Equal(p.SendUDP, []uint16{53}) || !slices.Equal(p.UnixSockets, []string{"/run/etcd/etcd.sock"}) {
		t.Errorf("UDP %v, sockets %v", p.SendUDP, p.UnixSockets)
	}
	if !slices.Contains(p.ReadFiles, "/etc/resolv.conf") || !slices.Contains(p.ReadDirs, "/etc/ssl") {
		t.Errorf("files %v, directories %v", p.ReadFiles, p.ReadDirs)
	}
	// Loopback by address only: no DNS.
	p, err = PolicyFor(parseConfig(t, "[sources.main]\ntype = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n"))
	if err != nil || !slices.Equal(p.ConnectTCP, []uint16{2379}) || len(p.SendUDP) != 0 {
		t.Errorf("%+v, %v", p, err)
	}
	// A mount's webhooks, which the worker delivers.
	p, err = PolicyFor(parseConfig(t, `[sources.main]
type = "etcd"
endpoints = ["http://127.0.0.1:2379"]
[[mount]]
name = "app"
dir = "/srv/app"
source = "main"
  [[mount.notify]]
  webhook = "http://127.0.0.1:9000/reload"
  [[mount.notify]]
  webhook = "https://hooks.example.com/kvmount"
`))
	slices.Sort(p.ConnectTCP)
	if err != nil || !slices.Equal(p.ConnectTCP, []uint16{53, 443, 2379, 9000}) || !slices.Equal(p.SendUDP, []uint16{53}) {
		t.Errorf("with webhooks: %+v, %v", p, err)
	}
}

// testReacher confines itself to the policy in KVMOUNT_TEST_POLICY, then
// reads key k from etcd at KVMOUNT_TEST_ETCD (its host is localhost,
// through /etc/hosts), GETs KVMOUNT_TEST_HTTP, loads the system's CA
// certificates, and dials KVMOUNT_TEST_OTHER_ADDR; it prints what it got
// and each error, as JSON.
func testReacher() error {
	var p Policy
	if err := json.Unmarshal([]byte(os.Getenv("KVMOUNT_TEST_POLICY")), &p); err != nil {
		return err
	}
	if _, err := Confine(p); err != nil {
		return err
	}
	out := map[string]string{}
	errOf := func(err error) string {
		if err != nil {
			return err.Error()
		}
		return ""
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{os.Getenv("KVMOUNT_TEST_ETCD")}, DialTimeout: 5 * time.Second})
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		var resp *clientv3.GetResponse
		if resp, err = cli.Get(ctx, "k"); err == nil && len(resp.Kvs) == 1 {
			out["etcd"] = string(resp.Kvs[0].Value)
		}
		cancel()
		cli.Close()
	}
	out["etcd error"] = errOf(err)
	resp, err := http.Get(os.Getenv("KVMOUNT_TEST_HTTP"))
	if err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		out["http"] = string(body)
	}
	out["http error"] = errOf(err)
	pool, err := x509.SystemCertPool()
	if err == nil && !pool.Equal(x509.NewCertPool()) {
		out["roots"] = "loaded"
	}
	out["roots error"] = errOf(err)
	conn, err := net.Dial("tcp", os.Getenv("KVMOUNT_TEST_OTHER_ADDR"))
	if err == nil {
		conn.Close()
	}
	out["other error"] = errOf(err)
	return json.NewEncoder(os.Stdout).Encode(out)
}

// TestConfinedWorkerReachesItsStores: a worker confined to PolicyFor of a
// configuration still does its job — reads etcd by a host name through
// gRPC, GETs an HTTP source, loads the system's CA certificates — and
// reaches nothing else.
func TestConfinedWorkerReachesItsStores(t *testing.T) {
	roottest.Require(t)
	srv, cli := etcdtest.Start(t)
	if _, err := cli.Put(context.Background(), "k", "from etcd"); err != nil {
		t.Fatal(err)
	}
	etcdURL := strings.Replace(srv.Endpoint(), "127.0.0.1", "localhost", 1)
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "from http") }))
	t.Cleanup(web.Close)
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	p, err := PolicyFor(parseConfig(t, fmt.Sprintf("[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n[sources.web]\ntype = \"http\"\nurl = %q\n", etcdURL, web.URL)))
	if err != nil {
		t.Fatal(err)
	}
	policy, _ := json.Marshal(p)
	u := roottest.NewUser(t)
	cmd := u.Helper(t, "reacher", "KVMOUNT_TEST_POLICY="+string(policy), "KVMOUNT_TEST_ETCD="+etcdURL,
		"KVMOUNT_TEST_HTTP="+web.URL, "KVMOUNT_TEST_OTHER_ADDR="+other.Addr().String())
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	w, err := Spawn(cmd, Identity{UID: u.UID, GID: u.GID})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Wait(); err != nil {
		t.Fatalf("the worker: %v\n%s", err, stderr.String())
	}
	var got map[string]string
	if err := json.Unmarshal([]byte(stdout.String()), &got); err != nil {
		t.Fatalf("%v: %q\n%s", err, stdout.String(), stderr.String())
	}
	want := map[string]string{"etcd": "from etcd", "etcd error": "", "http": "from http", "http error": "", "roots": "loaded", "roots error": ""}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %q; want %q", k, got[k], v)
		}
	}
	if !strings.Contains(got["other error"], "permission denied") {
		t.Errorf("a port outside the policy: %q; want it refused", got["other error"])
	}
}
