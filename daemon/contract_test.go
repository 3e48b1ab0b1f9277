package daemon

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/faultproxy"
)

// backend is one source kind with a real store behind it, as the contract
// suite drives it.
type backend interface {
	// upstream is the store's "host:port"; kvmount reaches it through a
	// fault proxy.
	upstream() string
	// sources returns the [sources.*] tables that reach the store at addr,
	// with a source "main" and, for binary values, the source that
	// binarySource names.
	sources(addr string) string
	// put applies key/value pairs as one change where the store can
	// (a transaction, one body); a value of etcdtest.Delete deletes.
	put(t *testing.T, kv ...string)
	// putBinary stores value under prefix+"bin" and returns the source and
	// prefix a mount projects it from, as the file "bin".
	putBinary(t *testing.T, prefix string, value []byte) (source, mountPrefix string)
}

// etcdBackend is the etcd source on an in-process etcd.
type etcdBackend struct {
	endpoint string
	cli      *clientv3.Client
}

func (b *etcdBackend) upstream() string { return strings.TrimPrefix(b.endpoint, "http://") }

func (b *etcdBackend) sources(addr string) string {
	return fmt.Sprintf("[sources.main]\ntype = \"etcd\"\nendpoints = [\"http://%s\"]\ndial_timeout = \"1s\"\n", addr)
}

func (b *etcdBackend) put(t *testing.T, kv ...string) {
	t.Helper()
	const maxOps = 100 // etcd's --max-txn-ops is 128
	for len(kv) > 0 {
		n := min(len(kv), 2*maxOps)
		etcdtest.Put(t, b.cli, kv[:n]...)
		kv = kv[n:]
	}
}

func (b *etcdBackend) putBinary(t *testing.T, prefix string, value []byte) (string, string) {
	b.put(t, prefix+"bin", string(value))
	return "main", prefix
}

// consulBackend is the Consul source on a real consul agent.
type consulBackend struct {
	agent  *consultest.Agent
	client *api.Client
}

func (b *consulBackend) upstream() string { return b.agent.Addr() }

func (b *consulBackend) sources(addr string) string {
	return fmt.Sprintf("[sources.main]\ntype = \"consul\"\naddress = \"http://%s\"\n", addr)
}

func (b *consulBackend) put(t *testing.T, kv ...string) {
	t.Helper()
	consultest.Txn(t, b.client, kv...)
}

func (b *consulBackend) putBinary(t *testing.T, prefix string, value []byte) (string, string) {
	b.put(t, prefix+"bin", string(value))
	return "main", prefix
}

// httpBackend is the HTTP source polling an httptest server that serves a
// flat JSON object of every key (with ETags, answering 304s), and raw
// bodies at /raw/NAME.
type httpBackend struct {
	srv *httptest.Server
	mu  sync.Mutex
	doc map[string]string
	raw map[string][]byte
}

func newHTTPBackend(t *testing.T) *httpBackend {
	b := &httpBackend{doc: map[string]string{}, raw: map[string][]byte{}}
	b.srv = httptest.NewServer(http.HandlerFunc(b.serve))
	t.Cleanup(b.srv.Close)
	return b
}

func (b *httpBackend) serve(w http.ResponseWriter, r *http.Request) {
	b.mu.Lock()
	var body []byte
	if name, ok := strings.CutPrefix(r.URL.Path, "/raw/"); ok {
		body = b.raw[name]
	} else {
		body, _ = json.Marshal(b.doc)
	}
	b.mu.Unlock()
	sum := sha256.Sum256(body)
	etag := `"` + hex.EncodeToString(sum[:8]) + `"`
	w.Header().Set("ETag", etag)
	if r.Header.Get("If-None-Match") == etag {
		w.WriteHeader(http.StatusNotModified)
		return
	}
	w.Write(body)
}

func (b *httpBackend) upstream() string { return strings.TrimPrefix(b.srv.URL, "http://") }

func (b *httpBackend) sources(addr string) string {
	return fmt.Sprintf("[sources.main]\ntype = \"http\"\nurl = \"http://%s/doc.json\"\npoll_interval = \"100ms\"\n\n"+
		"[sources.raw]\ntype = \"http\"\nurl = \"http://%s/raw/bin\"\nformat = \"raw\"\nkey = \"bin\"\npoll_interval = \"100ms\"\n", addr, addr)
}

func (b *httpBackend) put(t *testing.T, kv ...string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	next := maps.Clone(b.doc)
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] == etcdtest.Delete {
			delete(next, kv[i])
		} else {
			next[kv[i]] = kv[i+1]
		}
	}
	b.doc = next // one body: one change
}

func (b *httpBackend) putBinary(t *testing.T, _ string, value []byte) (string, string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.raw["bin"] = value // JSON strings cannot carry arbitrary bytes; the raw format can
	return "raw", ""
}

// contractHarness is a harness whose sources reach backend b through a
// fault proxy, so that a case can cut the network.
func contractHarness(t *testing.T, b backend) (*harness, *faultproxy.Proxy) {
	t.Helper()
	proxy, err := faultproxy.Start(b.upstream())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	h := newBareHarness(t)
	h.sources = func() string { return b.sources(proxy.Addr()) }
	return h, proxy
}

// contractCase is one behaviour every source must have.
type contractCase struct {
	name string
	run  func(t *testing.T, h *harness, proxy *faultproxy.Proxy, b backend, prefix string)
}

var contract = []contractCase{
	{"initial snapshot", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		b.put(t, p+"a.conf", "A", p+"dir/b.conf", "B", "elsewhere/x", "X")
		h.writeConfig(h.mount("m", p))
		h.start()
		h.waitContent(h.path("mnt", "m"), map[string]string{"a.conf": "A", "dir/b.conf": "B"})
	}},
	{"add, update, delete", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		b.put(t, p+"a", "1")
		h.writeConfig(h.mount("m", p))
		h.start()
		dir := h.path("mnt", "m")
		h.waitContent(dir, map[string]string{"a": "1"})
		b.put(t, p+"b", "2")
		h.waitContent(dir, map[string]string{"a": "1", "b": "2"})
		b.put(t, p+"a", "one")
		h.waitContent(dir, map[string]string{"a": "one", "b": "2"})
		b.put(t, p+"b", etcdtest.Delete)
		h.waitContent(dir, map[string]string{"a": "one"})
	}},
	{"10,000 keys", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		want := map[string]string{}
		var kv []string
		for i := range 10_000 {
			key := fmt.Sprintf("k%05d", i)
			want[key] = fmt.Sprint(i)
			kv = append(kv, p+key, want[key])
		}
		b.put(t, kv...)
		h.writeConfig(h.mount("m", p))
		h.start()
		h.waitContent(h.path("mnt", "m"), want)
		b.put(t, p+"k00042", "changed")
		want["k00042"] = "changed"
		h.waitContent(h.path("mnt", "m"), want)
	}},
	{"multi-key change is one switch", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		b.put(t, p+"a", "0", p+"b", "0", p+"c", "0")
		h.writeConfig(h.mount("m", p))
		h.start()
		dir := h.path("mnt", "m")
		h.waitContent(dir, map[string]string{"a": "0", "b": "0", "c": "0"})
		stop := readVersions(t, dir, []string{"a", "b", "c"}, func(version string, vals []string) {
			if vals[0] != vals[1] || vals[1] != vals[2] {
				t.Errorf("version %s mixes changes: %v", version, vals)
			}
		})
		for i := 1; i <= 50; i++ {
			v := fmt.Sprint(i)
			b.put(t, p+"a", v, p+"b", v, p+"c", v)
			time.Sleep(time.Millisecond) // let some of them reach the disk one by one
		}
		h.waitContent(dir, map[string]string{"a": "50", "b": "50", "c": "50"})
		if stop() == 0 {
			t.Error("no whole-version read was made")
		}
	}},
	{"outage keeps content, recovery resumes", func(t *testing.T, h *harness, proxy *faultproxy.Proxy, b backend, p string) {
		b.put(t, p+"a", "before")
		h.writeConfig(h.mount("m", p))
		h.start()
		dir := h.path("mnt", "m")
		version := h.waitContent(dir, map[string]string{"a": "before"})
		proxy.Cut()
		h.waitLog("mount stale", "mount=m")
		b.put(t, p+"a", "during")
		if got, v := content(dir); got["a"] != "before" || v != version {
			t.Errorf("content changed during the outage: %v at %s", got, v)
		}
		if err := proxy.Restore(); err != nil {
			t.Fatal(err)
		}
		h.waitContent(dir, map[string]string{"a": "during"})
		h.waitLog("mount current", "mount=m")
	}},
	{"many prefixes of one source", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		const n = 60
		var kv []string
		var mounts strings.Builder
		for i := range n {
			kv = append(kv, fmt.Sprintf("%sm%02d/k", p, i), fmt.Sprint(i))
			mounts.WriteString(h.mount(fmt.Sprintf("m%02d", i), fmt.Sprintf("%sm%02d/", p, i)))
		}
		b.put(t, kv...)
		h.writeConfig(mounts.String())
		h.start()
		for i := range n {
			h.waitContent(h.path("mnt", fmt.Sprintf("m%02d", i)), map[string]string{"k": fmt.Sprint(i)})
		}
		b.put(t, fmt.Sprintf("%sm%02d/k", p, n-1), "last")
		h.waitContent(h.path("mnt", fmt.Sprintf("m%02d", n-1)), map[string]string{"k": "last"})
	}},
	{"missing prefix", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		b.put(t, p+"present", "1")
		h.writeConfig(h.mount("required", p+"nothing-here/") + h.mount("opt", p+"nothing-here/", "optional = true"))
		h.start()
		h.waitLog("cannot build mount payload", "mount=required", "does not exist")
		h.waitContent(h.path("mnt", "opt"), map[string]string{})
		if _, err := os.Lstat(h.path("mnt", "required")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the required mount was created: %v", err)
		}
	}},
	{"binary values", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		value := []byte{0, 1, 2, 0xff, 0xfe, '\n', 0x80, 0}
		src, prefix := b.putBinary(t, p, value)
		h.writeConfig(fmt.Sprintf("[[mount]]\nname = \"m\"\ndir = %q\nsource = %q\nprefix = %q\n", h.path("mnt", "m"), src, prefix))
		h.start()
		h.waitContent(h.path("mnt", "m"), map[string]string{"bin": string(value)})
	}},
	{"keys with spaces and non-ASCII", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		b.put(t, p+"with space.conf", "s", p+"ünïcödé/日本語.txt", "u", p+"emoji-🙂", "e")
		h.writeConfig(h.mount("m", p))
		h.start()
		h.waitContent(h.path("mnt", "m"), map[string]string{"with space.conf": "s", "ünïcödé/日本語.txt": "u", "emoji-🙂": "e"})
	}},
	{"keys that would escape are rejected", func(t *testing.T, h *harness, _ *faultproxy.Proxy, b backend, p string) {
		b.put(t, p+"good", "1", p+"../escape", "x", p+"a/../../up", "x", p+"..data", "x")
		h.writeConfig(h.mount("m", p))
		h.start()
		dir := h.path("mnt", "m")
		h.waitContent(dir, map[string]string{"good": "1"})
		h.waitLog("rejected key", "mount=m", "escape")
		b.put(t, p+"good", "2")
		h.waitContent(dir, map[string]string{"good": "2"})
		for _, outside := range []string{h.path("mnt", "escape"), h.path("escape"), h.path("up"), h.path("mnt", "up")} {
			if _, err := os.Lstat(outside); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("%s exists: a key escaped the mount", outside)
			}
		}
	}},
}

// TestContract runs every contract case against every source kind, each
// with a real store: an in-process etcd, a consul agent, an httptest server.
func TestContract(t *testing.T) {
	backends := []struct {
		name string
		make func(t *testing.T) backend
	}{
		{"etcd", func(t *testing.T) backend {
			srv, cli := etcdtest.Start(t)
			return &etcdBackend{endpoint: srv.Endpoint(), cli: cli}
		}},
		{"consul", func(t *testing.T) backend {
			agent := consultest.Start(t)
			return &consulBackend{agent: agent, client: agent.Client()}
		}},
		{"http", func(t *testing.T) backend { return newHTTPBackend(t) }},
	}
	for _, bk := range backends {
		t.Run(bk.name, func(t *testing.T) {
			b := bk.make(t)
			for i, c := range contract {
				t.Run(c.name, func(t *testing.T) {
					h, proxy := contractHarness(t, b)
					c.run(t, h, proxy, b, fmt.Sprintf("case%d/", i))
				})
			}
		})
	}
}
