package vault

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/source"
)

// failingVault is an HTTP server that answers as a Vault holding a KV
// secret, a database credential under a renewable lease, a PKI role and an
// AppRole login — every lease and token lasting ttl — until fail is
// called; from then on it answers every request with what an HA cluster's
// nodes answer during a failover, in turn: 503 (sealed), 500 (not the
// active node), 307 to another node, 400 (lease not found). It records
// when each failing answer went out and on which connection.
type failingVault struct {
	srv *httptest.Server
	ttl int
	// elsewhere is where the 307s point; it counts what reaches it.
	elsewhere *httptest.Server
	redirects atomic.Int64

	mu      sync.Mutex
	failing bool
	turn    int
	// during are the times of the requests answered while failing.
	during []time.Time
	// failedOn are the connections (remote addresses) a 5xx or a redirect
	// was answered on; reused counts requests that came on one of them
	// again.
	failedOn map[string]bool
	reused   int
	logins   int
}

func newFailingVault(t *testing.T, ttl int) *failingVault {
	t.Helper()
	v := &failingVault{ttl: ttl, failedOn: map[string]bool{}}
	v.elsewhere = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		v.redirects.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(v.elsewhere.Close)
	v.srv = httptest.NewServer(http.HandlerFunc(v.serve))
	t.Cleanup(v.srv.Close)
	return v
}

// fail makes every later request fail.
func (v *failingVault) fail() {
	v.mu.Lock()
	v.failing = true
	v.mu.Unlock()
}

// heal makes the server answer as Vault again.
func (v *failingVault) heal() {
	v.mu.Lock()
	v.failing = false
	v.mu.Unlock()
}

// failed returns the times of the requests answered while failing, and
// how many came on a connection that had answered a failure before.
func (v *failingVault) failed() ([]time.Time, int) {
	v.mu.Lock()
	defer v.mu.Unlock()
	return append([]time.Time(nil), v.during...), v.reused
}

func (v *failingVault) serve(w http.ResponseWriter, r *http.Request) {
	v.mu.Lock()
	if v.failedOn[r.RemoteAddr] {
		v.reused++
	}
	if v.failing {
		v.during = append(v.during, time.Now())
		v.turn++
		turn := v.turn
		// A 5xx and a redirect close their connection; a 400 need not.
		v.failedOn[r.RemoteAddr] = turn%4 != 3
		v.mu.Unlock()
		switch turn % 4 {
		case 0:
			reply(w, http.StatusServiceUnavailable, map[string]any{"errors": []string{"Vault is sealed"}})
		case 1:
			reply(w, http.StatusInternalServerError, map[string]any{"errors": []string{"local node not active but active cluster node not found"}})
		case 2:
			w.Header().Set("Location", v.elsewhere.URL+r.URL.RequestURI())
			w.WriteHeader(http.StatusTemporaryRedirect)
		case 3:
			reply(w, http.StatusBadRequest, map[string]any{"errors": []string{"lease not found"}})
		}
		return
	}
	if r.URL.Path == "/v1/auth/approle/login" {
		v.logins++
	}
	logins := v.logins
	v.mu.Unlock()
	auth := map[string]any{"auth": map[string]any{"client_token": fmt.Sprintf("token-%d", logins), "accessor": "a", "lease_duration": v.ttl, "renewable": true}}
	switch p := r.URL.Path; {
	case p == "/v1/auth/approle/login" || p == "/v1/auth/token/renew-self":
		reply(w, http.StatusOK, auth)
	case strings.HasPrefix(p, "/v1/sys/internal/ui/mounts/secret/app"):
		reply(w, http.StatusOK, map[string]any{"data": map[string]any{"path": "secret/", "type": "kv", "options": map[string]any{"version": "2"}}})
	case strings.HasPrefix(p, "/v1/secret/metadata/app") && r.URL.Query().Get("list") == "true":
		reply(w, http.StatusOK, map[string]any{"data": map[string]any{"keys": []string{"db"}}})
	case p == "/v1/secret/metadata/app/db":
		reply(w, http.StatusOK, map[string]any{"data": map[string]any{"current_version": 1, "versions": map[string]any{"1": map[string]any{"deletion_time": "", "destroyed": false}}}})
	case p == "/v1/secret/data/app/db":
		reply(w, http.StatusOK, map[string]any{"data": map[string]any{"data": map[string]any{"password": "p"}, "metadata": map[string]any{"version": 1}}})
	case p == "/v1/sys/internal/ui/mounts/database/creds/app":
		reply(w, http.StatusOK, map[string]any{"data": map[string]any{"path": "database/", "type": "database"}})
	case p == "/v1/database/creds/app":
		reply(w, http.StatusOK, map[string]any{"lease_id": fmt.Sprintf("database/creds/app/%d", time.Now().UnixNano()), "lease_duration": v.ttl, "renewable": true,
			"data": map[string]any{"username": "u", "password": "p"}})
	case p == "/v1/sys/leases/renew":
		var body struct {
			LeaseID string `json:"lease_id"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		reply(w, http.StatusOK, map[string]any{"lease_id": body.LeaseID, "lease_duration": v.ttl, "renewable": true})
	case p == "/v1/pki/issue/web":
		reply(w, http.StatusOK, map[string]any{"data": selfSigned(time.Duration(v.ttl) * time.Second)})
	default:
		reply(w, http.StatusNotFound, map[string]any{"errors": []string{}})
	}
}

func reply(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

// selfSigned returns a PKI issue response's fields for a certificate
// valid for validity.
func selfSigned(validity time.Duration) map[string]any {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		panic(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: "web.example.com"},
		NotBefore: time.Now().Add(-time.Second), NotAfter: time.Now().Add(validity)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		panic(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	cert := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	return map[string]any{
		"certificate": cert, "issuing_ca": cert, "ca_chain": []string{cert},
		"private_key":   string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})),
		"serial_number": fmt.Sprintf("%x", serial),
	}
}

// TestRetriesBoundedWhateverVaultAnswers: with a token, a KV folder, a
// leased database credential and a certificate — tokens, leases and
// certificates of 6 s, so that renewals and issues fall due during the
// outage — a server that answers 503, 500, 307 and 400 in turn gets at
// most a few requests a second from the source (the API client's
// lifetime watcher sent tens of thousands), never a second request on a
// connection that answered a 5xx or a redirect, and nothing at the address its
// redirects name; the log says why the token was replaced, and once the
// server answers again every follow is healthy within 2 × poll_interval +
// 10 s.
func TestRetriesBoundedWhateverVaultAnswers(t *testing.T) {
	v := newFailingVault(t, 6)
	dir := t.TempDir()
	src, logs := openTest(t, fmt.Sprintf("address = %q\npoll_interval = \"1s\"\n[sources.v.approle]\nrole_id_file = %q\nsecret_id_file = %q\n",
		v.srv.URL, writeFile(t, dir, "role-id", "r"), writeFile(t, dir, "secret-id", "s")))
	pki := pkiRequest{role: "pki/issue/web", commonName: "web.example.com"}.String()
	var recs []*sourcetest.Recorder
	for _, p := range []string{"secret/app/", "database/creds/app", pki} {
		rec := sourcetest.Follow(t, src, p)
		rec.WaitFor(t, p, func(snaps []source.Snapshot, err error) bool { return len(snaps) > 0 && err == nil })
		recs = append(recs, rec)
	}

	v.fail()
	const outage = 10 * time.Second
	start := time.Now()
	time.Sleep(outage)
	during, reused := v.failed()
	var bins [int(outage / time.Second)]int
	for _, at := range during {
		if i := int(at.Sub(start) / time.Second); i >= 0 && i < len(bins) {
			bins[i]++
		}
	}
	t.Logf("requests during the outage: %d, per second %v", len(during), bins)
	if len(during) > 40 {
		t.Errorf("%d requests in %v; want at most 4 a second", len(during), outage)
	}
	for i, n := range bins {
		if n > 8 {
			t.Errorf("%d requests in second %d of the outage; want at most 8", n, i)
		}
	}
	if reused > 0 {
		t.Errorf("%d requests came on a connection that had answered a 5xx or a redirect", reused)
	}
	if n := v.redirects.Load(); n > 0 {
		t.Errorf("%d redirects followed", n)
	}
	if logs.Count("could not renew the vault token; retrying") == 0 {
		t.Error("no failed renewal of the token logged")
	}
	if logs.Count("replacing the vault token", "renewing it failed") == 0 || logs.Count("maximum TTL") > 0 {
		t.Errorf("the token's replacement is not logged with its reason:\n%s", logs)
	}
	if !strings.Contains(logs.String(), "redirects are not followed") {
		t.Error("a redirect's error does not say it is not followed")
	}

	for i, rec := range recs {
		if _, err := rec.State(); err == nil {
			t.Errorf("follow %d reports no failure during the outage", i)
		}
	}

	v.heal()
	healed := time.Now()
	for i, rec := range recs {
		rec.WaitFor(t, "healthy again", func(_ []source.Snapshot, err error) bool { return err == nil })
		if took := time.Since(healed); took > 2*time.Second+10*time.Second {
			t.Errorf("follow %d healthy %v after the server answered again; want within 2 × poll_interval + 10 s", i, took)
		}
	}
}
