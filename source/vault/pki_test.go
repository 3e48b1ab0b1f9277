package vault

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/vaulttest"
	"github.com/kvmount/kvmount/source"
)

// enablePKI mounts a PKI engine at pki/ with a root CA and the role web
// (example.com and its subdomains), with generate_lease as lease says.
func enablePKI(t *testing.T, srv *vaulttest.Server, lease bool) {
	t.Helper()
	srv.Write(t, "sys/mounts/pki", map[string]any{"type": "pki", "config": map[string]any{"max_lease_ttl": "87600h"}})
	srv.Write(t, "pki/root/generate/internal", map[string]any{"common_name": "example.com", "ttl": "8760h"})
	srv.Write(t, "pki/roles/web", map[string]any{"allowed_domains": "example.com", "allow_subdomains": true, "max_ttl": "72h",
		"generate_lease": lease, "not_before_duration": "1s", "key_type": "ec", "key_bits": 256})
}

// checkPair checks that a PKI snapshot's certificate and private key match
// (tls.X509KeyPair), that the certificate names cn and alt, and that its
// CA files hold certificates; it returns the certificate.
func checkPair(t *testing.T, s source.Snapshot, cn, alt string) *x509.Certificate {
	t.Helper()
	pair, err := tls.X509KeyPair(s.Entries.ValueOf(FileCertificate), s.Entries.ValueOf(FilePrivateKey))
	if err != nil {
		t.Fatalf("snapshot %s: the certificate and key do not match: %v", s.Revision, err)
	}
	cert := pair.Leaf
	if cert == nil {
		if cert, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			t.Fatal(err)
		}
	}
	if cert.Subject.CommonName != cn || !slices.Contains(cert.DNSNames, alt) {
		t.Errorf("certificate of %s, %v; want %s and %s", cert.Subject.CommonName, cert.DNSNames, cn, alt)
	}
	for _, name := range []string{FileIssuingCA, FileCAChain} {
		if _, err := parseCertificate(s.Entries.ValueOf(name)); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	return cert
}

// TestPKI issues a certificate with a short TTL and again at two thirds of
// each one's validity: each snapshot is a certificate with its own key,
// and templates read the issue by its role with its parameters.
func TestPKI(t *testing.T) {
	srv := vaulttest.Start(t)
	enablePKI(t, srv, false)
	src, logs := tokenSource(t, srv, "")
	req := pkiRequest{role: "pki/issue/web", commonName: "web.example.com", altNames: []string{"www.example.com"}, ttl: "3s"}
	rec := sourcetest.Follow(t, src, req.String())
	rec.WaitFor(t, "three certificates", func(snaps []source.Snapshot, _ error) bool { return len(snaps) >= 3 })
	snaps := mustSnaps(rec)
	var last *x509.Certificate
	for _, s := range snaps {
		cert := checkPair(t, s, "web.example.com", "www.example.com")
		if last != nil {
			if cert.SerialNumber.Cmp(last.SerialNumber) == 0 {
				t.Errorf("serial %x issued twice", cert.SerialNumber)
			}
			// Issued again at two thirds of the validity, not at its end.
			if gap := cert.NotBefore.Sub(last.NotBefore); gap > 3*time.Second || gap < time.Second {
				t.Errorf("issued %v after the previous one; want about 2 s (two thirds of 3 s)", gap)
			}
		}
		last = cert
	}
	s := snaps[0].Secrets["pki/issue/web"]
	if s == nil || s.Data["certificate"] != string(snaps[0].Entries.ValueOf(FileCertificate)) {
		t.Fatalf("templates do not read the issue by its role: %v", snaps[0].Secrets)
	}
	if logs.Count("issued a certificate", "role=pki/issue/web") < 3 {
		t.Errorf("issues not logged:\n%s", logs)
	}
	if !src.cfg.HoldsSecret(req.String(), "pki/issue/web", []string{"common_name=web.example.com", "ttl=3s"}) ||
		src.cfg.HoldsSecret(req.String(), "pki/issue/web", []string{"common_name=other.example.com"}) {
		t.Error("HoldsSecret does not compare the issue's parameters")
	}
}

// TestPKILeaseRevokedOnRelease: a certificate issued with generate_lease
// is revoked when no mount follows its projection any more, and not when
// the follow ends otherwise (the daemon's stop).
func TestPKILeaseRevokedOnRelease(t *testing.T) {
	srv := vaulttest.Start(t)
	enablePKI(t, srv, true)
	src, logs := tokenSource(t, srv, "")
	revoked := func(serial string) bool {
		t.Helper()
		s, err := srv.Client(t).Logical().Read("pki/cert/" + serial)
		if err != nil || s == nil {
			t.Fatalf("pki/cert/%s: %v", serial, err)
		}
		n, _ := s.Data["revocation_time"].(json.Number).Int64()
		return n > 0
	}
	for _, tc := range []struct {
		cause  error
		revoke bool
	}{{nil, false}, {source.ErrReleased, true}} {
		req := pkiRequest{role: "pki/issue/web", commonName: fmt.Sprintf("r%t.example.com", tc.revoke), ttl: "1h"}
		rec, stop := sourcetest.FollowStoppable(t, src, req.String(), source.Limits{})
		rec.WaitFor(t, "the certificate", func(snaps []source.Snapshot, _ error) bool { return len(snaps) == 1 })
		snap := mustSnaps(rec)[0]
		if snap.Secrets["pki/issue/web"].LeaseID == "" {
			t.Fatal("no lease with generate_lease")
		}
		serial := snap.Revision[len("serial:"):]
		stop(tc.cause)
		if got := revoked(serial); got != tc.revoke {
			t.Errorf("follow ended with %v: certificate revoked %t; want %t", tc.cause, got, tc.revoke)
		}
	}
	if logs.Count("revoked the lease of a projection no mount follows any more", "projection=pki/issue/web") != 1 {
		t.Errorf("the revocation was not logged once:\n%s", logs)
	}
}
