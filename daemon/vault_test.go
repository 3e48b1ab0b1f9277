package daemon

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/faultproxy"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/internal/vaulttest"
)

// vaultHarness returns a harness whose source "main" reads a real Vault
// dev server through a fault proxy, with the root token from a token file,
// polling every 100 ms.
func vaultHarness(t *testing.T) (*harness, *vaulttest.Server, *faultproxy.Proxy) {
	t.Helper()
	srv := vaulttest.Start(t)
	proxy, err := faultproxy.Start(srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	h := newBareHarness(t)
	token := h.path("vault-token")
	if err := os.WriteFile(token, []byte(vaulttest.RootToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	h.sources = func() string {
		return fmt.Sprintf("[sources.main]\ntype = \"vault\"\naddress = \"http://%s\"\ntoken_file = %q\npoll_interval = \"100ms\"\n", proxy.Addr(), token)
	}
	return h, srv, proxy
}

// tmpfsMount returns a [[mount]] of the harness on tmpfs, unmounted when
// the test ends (by the harness, after the daemon stops).
func (h *harness) tmpfsMount(name, prefix string, extra ...string) string {
	return h.mount(name, prefix, append([]string{`medium = "tmpfs"`}, extra...)...)
}

// TestVaultKV projects a KV v2 folder onto tmpfs: one file per field below
// each secret's path; a change of two secrets is one switch; a deleted
// secret's files go; with the server unreachable the mount is stale and
// keeps its content, and follows again once it is back.
func TestVaultKV(t *testing.T) {
	roottest.Require(t)
	h, srv, proxy := vaultHarness(t)
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p1"})
	srv.Put(t, "secret", "app/api", map[string]any{"key": "k1"})
	h.writeConfig(h.tmpfsMount("app", "secret/app/", `default_mode = "0400"`))
	h.start()
	dir := h.path("mnt", "app")
	h.waitContent(dir, map[string]string{"db/user": "ada", "db/password": "p1", "api/key": "k1"})
	if st, err := os.Stat(filepath.Join(dir, "db", "password")); err != nil || st.Mode().Perm() != 0o400 {
		t.Errorf("db/password: %v, %v; want mode 0400", st, err)
	}

	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p2"})
	srv.Put(t, "secret", "app/api", map[string]any{"key": "k2"})
	h.waitContent(dir, map[string]string{"db/user": "ada", "db/password": "p2", "api/key": "k2"})
	if err := srv.Client(t).KVv2("secret").Delete(context.Background(), "app/api"); err != nil {
		t.Fatal(err)
	}
	version := h.waitContent(dir, map[string]string{"db/user": "ada", "db/password": "p2"})

	proxy.Cut()
	h.waitLog("mount stale", "mount=app")
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p3"})
	time.Sleep(300 * time.Millisecond) // three polls' worth
	if got, v := content(dir); got["db/password"] != "p2" || v != version {
		t.Errorf("content changed during the outage: %v at %s", got, v)
	}
	if err := proxy.Restore(); err != nil {
		t.Fatal(err)
	}
	h.waitContent(dir, map[string]string{"db/user": "ada", "db/password": "p3"})
	h.waitLog("mount current", "mount=app")
	if strings.Contains(h.logs.String(), vaulttest.RootToken) {
		t.Error("the log holds the token")
	}
}

// enableVaultPKI mounts a PKI engine at pki/ with a root CA and the role
// web for example.com and its subdomains.
func enableVaultPKI(t testing.TB, srv *vaulttest.Server, lease bool) {
	t.Helper()
	srv.Write(t, "sys/mounts/pki", map[string]any{"type": "pki", "config": map[string]any{"max_lease_ttl": "87600h"}})
	srv.Write(t, "pki/root/generate/internal", map[string]any{"common_name": "example.com", "ttl": "8760h"})
	srv.Write(t, "pki/roles/web", map[string]any{"allowed_domains": "example.com", "allow_subdomains": true, "max_ttl": "72h",
		"generate_lease": lease, "not_before_duration": "1s", "key_type": "ec", "key_bits": 256})
}

// serialOf returns the serial number of the PEM certificate data, as Vault
// writes it (hex pairs with colons).
func serialOf(t testing.TB, data string) string {
	t.Helper()
	block, _ := pem.Decode([]byte(data))
	if block == nil {
		t.Fatalf("no PEM certificate in %q", data)
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	var pairs []string
	for _, b := range cert.SerialNumber.Bytes() {
		pairs = append(pairs, fmt.Sprintf("%02x", b))
	}
	return strings.Join(pairs, ":")
}

// TestVaultPKIRotation issues a certificate with a 3 s TTL, so that it is
// issued again about every 2 s: a reader looping on the mount, resolving
// ..data once a round, never sees a certificate whose public key does not
// match the private key beside it; the notify command runs once per new
// pair, after it is in place.
func TestVaultPKIRotation(t *testing.T) {
	roottest.Require(t)
	h, srv, _ := vaultHarness(t)
	enableVaultPKI(t, srv, false)
	notified := h.path("notified")
	// The command runs as nobody: the file is everyone's to append to.
	if err := os.WriteFile(notified, nil, 0o666); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(notified, 0o666); err != nil {
		t.Fatal(err)
	}
	dir := h.path("mnt", "tls")
	h.writeConfig(h.tmpfsMount("tls", "", `default_mode = "0440"`, `group = "0"`,
		"[mount.pki]\nrole = \"pki/issue/web\"\ncommon_name = \"web.example.com\"\nalt_names = [\"www.example.com\"]\nttl = \"3s\"\n",
		"[[mount.notify]]\ncommand = [\"sh\", \"-c\", \"echo \\\"$KVMOUNT_REVISION\\\" >> "+notified+"\"]\n"))
	h.start()
	h.waitLog("issued a certificate", "role=pki/issue/web")
	files := []string{"certificate", "private_key", "issuing_ca", "ca_chain"}
	deadline := time.Now().Add(waitTimeout)
	for {
		if got, _ := content(dir); len(got) == len(files) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the certificate never reached the mount")
		}
		time.Sleep(10 * time.Millisecond)
	}
	versions := map[string]string{} // version directory → serial
	stop := readVersions(t, dir, files, func(version string, values []string) {
		if _, err := tls.X509KeyPair([]byte(values[0]), []byte(values[1])); err != nil {
			t.Errorf("version %s: certificate and key do not match: %v", version, err)
		}
		versions[version] = serialOf(t, values[0])
	})
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(50 * time.Millisecond) {
		if data, _ := os.ReadFile(notified); strings.Count(string(data), "\n") >= 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fewer than four notifications")
		}
	}
	if stop() == 0 {
		t.Fatal("no complete read of a version")
	}
	h.stop()
	data, _ := os.ReadFile(notified)
	lines := strings.Fields(string(data))
	var serials []string
	for _, line := range lines {
		serial, ok := strings.CutPrefix(line, "main@serial:")
		if !ok {
			t.Fatalf("notified for %q; want main@serial:SERIAL", line)
		}
		if slices.Contains(serials, serial) {
			t.Errorf("notified twice for certificate %s", serial)
		}
		serials = append(serials, serial)
	}
	seen := 0
	for _, serial := range versions {
		if slices.Contains(serials, serial) {
			seen++
		}
	}
	if seen < 2 {
		t.Errorf("the reader saw %d of the %d notified certificates (versions %v)", seen, len(serials), versions)
	}
	if issued := h.logs.Count("issued a certificate", "role=pki/issue/web"); issued < len(serials) {
		t.Errorf("%d notifications for %d certificates issued", len(serials), issued)
	}
}

// TestVaultTemplates renders consul-template's secret from the mount's
// Vault projections — a KV v2 secret by its API path, a PKI issue as one
// PEM bundle (certificate, then key) — and renders again when they change.
func TestVaultTemplates(t *testing.T) {
	roottest.Require(t)
	h, srv, _ := vaultHarness(t)
	enableVaultPKI(t, srv, false)
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p1", "port": 5432})
	dir := h.path("mnt", "app")
	h.writeConfig(fmt.Sprintf(`[[mount]]
name = "app"
dir = %q
medium = "tmpfs"
keys_as_files = false

  [[mount.projections]]
  source = "main"
  prefix = "secret/app/"

  [[mount.projections]]
  source = "main"
    [mount.projections.pki]
    role = "pki/issue/web"
    common_name = "web.example.com"
    ttl = "1h"

  [[mount.templates]]
  path = "db.conf"
  text = '''{{ with secret "secret/data/app/db" }}postgres://{{ .Data.data.user }}:{{ .Data.data.password }}@db:{{ .Data.data.port }} v{{ .Data.metadata.version }}{{ end }}'''

  [[mount.templates]]
  path = "bundle.pem"
  text = '''{{ with secret "pki/issue/web" "common_name=web.example.com" }}{{ .Data.certificate }}
{{ .Data.private_key }}{{ end }}'''
`, dir))
	h.start()
	h.waitLog("issued a certificate")
	var bundle string
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		got, _ := content(dir)
		if got["db.conf"] == "postgres://ada:p1@db:5432 v1" && got["bundle.pem"] != "" {
			bundle = got["bundle.pem"]
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("mount holds %v", got)
		}
	}
	if _, err := tls.X509KeyPair([]byte(bundle), []byte(bundle)); err != nil {
		t.Errorf("the bundle is not a matching certificate and key: %v", err)
	}
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "p2", "port": 5432})
	h.waitContent(dir, map[string]string{"db.conf": "postgres://ada:p2@db:5432 v2", "bundle.pem": bundle})
}

// TestVaultLeaseRevokedWhenMountRemoved: a certificate issued with the
// role's generate_lease is revoked when its mount leaves the
// configuration — and not when the daemon restarts.
func TestVaultLeaseRevokedWhenMountRemoved(t *testing.T) {
	roottest.Require(t)
	h, srv, _ := vaultHarness(t)
	enableVaultPKI(t, srv, true)
	pki := func(name string) string {
		return h.tmpfsMount(name, "", fmt.Sprintf("[mount.pki]\nrole = \"pki/issue/web\"\ncommon_name = \"%s.example.com\"\nttl = \"1h\"\n", name))
	}
	revoked := func(serial string) bool {
		t.Helper()
		s, err := srv.Client(t).Logical().Read("pki/cert/" + serial)
		if err != nil || s == nil {
			t.Fatalf("pki/cert/%s: %v", serial, err)
		}
		n, _ := s.Data["revocation_time"].(json.Number).Int64()
		return n > 0
	}
	// serial waits for a certificate in mount name other than the one of
	// serial not, and returns its serial.
	serial := func(name, not string) string {
		t.Helper()
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
			if got, _ := content(h.path("mnt", name)); got["certificate"] != "" && serialOf(t, got["certificate"]) != not {
				return serialOf(t, got["certificate"])
			}
			if time.Now().After(deadline) {
				t.Fatalf("no certificate in mount %s", name)
			}
		}
	}
	h.writeConfig(pki("kept") + pki("removed"))
	h.start()
	kept, removed := serial("kept", ""), serial("removed", "")
	h.stop()
	if revoked(kept) || revoked(removed) {
		t.Fatal("a stop revoked a certificate")
	}
	h.start()
	// A restart issues both again at once: the files on disk are older
	// than it.
	kept2, removed2 := serial("kept", kept), serial("removed", removed)
	h.writeConfig(pki("kept"))
	h.sighup()
	h.waitLog("revoked the lease of a projection no mount follows any more")
	if !revoked(removed2) {
		t.Errorf("certificate %s of the removed mount is not revoked", removed2)
	}
	if revoked(kept2) || revoked(kept) {
		t.Error("the kept mount's certificate was revoked")
	}
}

// TestVaultPKIItems renames a certificate's files with items, as a service
// that wants tls.crt and tls.key does; the files left out are not written,
// and an item's mode applies.
func TestVaultPKIItems(t *testing.T) {
	roottest.Require(t)
	h, srv, _ := vaultHarness(t)
	enableVaultPKI(t, srv, false)
	dir := h.path("mnt", "tls")
	h.writeConfig(h.tmpfsMount("tls", "", `default_mode = "0444"`,
		"[mount.pki]\nrole = \"pki/issue/web\"\ncommon_name = \"web.example.com\"\nttl = \"1h\"\n",
		"[[mount.items]]\nkey = \"certificate\"\npath = \"tls.crt\"\n",
		"[[mount.items]]\nkey = \"private_key\"\npath = \"tls.key\"\nmode = \"0400\"\n"))
	h.start()
	var got map[string]string
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		if got, _ = content(dir); got["tls.key"] != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("mount holds %s", summary(got))
		}
	}
	if len(got) != 2 {
		t.Errorf("mount holds %s; want tls.crt and tls.key only", summary(got))
	}
	if _, err := tls.X509KeyPair([]byte(got["tls.crt"]), []byte(got["tls.key"])); err != nil {
		t.Errorf("tls.crt and tls.key do not match: %v", err)
	}
	for name, mode := range map[string]os.FileMode{"tls.crt": 0o444, "tls.key": 0o400} {
		if st, err := os.Stat(filepath.Join(dir, name)); err != nil || st.Mode().Perm() != mode {
			t.Errorf("%s: %v, %v; want mode %v", name, st.Mode(), err, mode)
		}
	}
}
