package vault

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strings"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/kvset"
	"github.com/kvmount/kvmount/render"
	"github.com/kvmount/kvmount/source"
)

// The files of a PKI projection, the fields of Vault's issue response
// (pki/issue/ROLE).
const (
	FileCertificate = "certificate"
	FilePrivateKey  = "private_key"
	FileIssuingCA   = "issuing_ca"
	FileCAChain     = "ca_chain"
)

// pkiRequest is a [mount.pki] table: the certificate a PKI role issues.
type pkiRequest struct {
	// role is the issue endpoint, such as "pki/issue/web".
	role       string
	commonName string
	altNames   []string
	ipSANs     []string
	// ttl is the requested validity as written ("24h"); "" for the role's.
	ttl string
}

// String returns the request as the prefix a PKI projection follows:
// the role's path, then its parameters as a URL query, in key order
// ("pki/issue/web?alt_names=www.example.com&common_name=web.example.com&ttl=24h").
func (r pkiRequest) String() string {
	return r.role + "?" + r.values().Encode()
}

// values returns the issue's parameters.
func (r pkiRequest) values() url.Values {
	v := url.Values{}
	v.Set("common_name", r.commonName)
	if len(r.altNames) > 0 {
		v.Set("alt_names", strings.Join(r.altNames, ","))
	}
	if len(r.ipSANs) > 0 {
		v.Set("ip_sans", strings.Join(r.ipSANs, ","))
	}
	if r.ttl != "" {
		v.Set("ttl", r.ttl)
	}
	return v
}

// param returns the issue's parameter k as Vault takes it ("" when unset).
func (r pkiRequest) param(k string) string { return r.values().Get(k) }

// params returns the issue's parameters, for templates (render.NewSecret).
func (r pkiRequest) params() map[string]string {
	out := map[string]string{}
	for k, v := range r.values() {
		out[k] = v[0]
	}
	return out
}

// parsePKIRequest parses what String returns; ok is false for a path.
func parsePKIRequest(prefix string) (pkiRequest, bool) {
	role, query, ok := strings.Cut(prefix, "?")
	if !ok {
		return pkiRequest{}, false
	}
	v, err := url.ParseQuery(query)
	if err != nil {
		return pkiRequest{}, false
	}
	r := pkiRequest{role: role, commonName: v.Get("common_name"), ttl: v.Get("ttl")}
	if s := v.Get("alt_names"); s != "" {
		r.altNames = strings.Split(s, ",")
	}
	if s := v.Get("ip_sans"); s != "" {
		r.ipSANs = strings.Split(s, ",")
	}
	return r, true
}

// decodePKI reads a [mount.pki] table: role (the issue endpoint, such as
// "pki/issue/web"), common_name, and optionally alt_names, ip_sans and ttl.
func decodePKI(sec *config.Section) pkiRequest {
	defer sec.Done()
	r := pkiRequest{
		role:       strings.Trim(sec.String("role", ""), "/"),
		commonName: sec.String("common_name", ""),
		altNames:   sec.Strings("alt_names"),
		ipSANs:     sec.Strings("ip_sans"),
		ttl:        sec.String("ttl", ""),
	}
	switch parts := strings.Split(r.role, "/"); {
	case r.role == "":
		sec.Errorf("", "role is missing: the issue endpoint of a PKI role, such as \"pki/issue/web\"")
	case checkPath(r.role) != nil || len(parts) < 3 || parts[len(parts)-2] != "issue":
		sec.Errorf("role", "%q: want the issue endpoint of a PKI role, MOUNT/issue/ROLE, such as \"pki/issue/web\"", r.role)
	}
	if r.commonName == "" {
		sec.Errorf("", "common_name is missing")
	}
	for _, list := range [][]string{r.altNames, r.ipSANs} {
		for _, name := range list {
			if name == "" || strings.Contains(name, ",") {
				sec.Errorf("alt_names", "%q: a name may not be empty or hold a comma", name)
			}
		}
	}
	if r.ttl != "" {
		if d, err := time.ParseDuration(r.ttl); err != nil || d <= 0 {
			sec.Errorf("ttl", "%q: want a positive duration, such as \"24h\"", r.ttl)
		}
	}
	return r
}

// DefaultItems implements config.ItemDefaulter: a PKI projection without
// items projects its four files, the private key 0600 unless the mount
// writes default_mode — a key readable by every user is a key given away.
// A path projection has none.
func (c *Config) DefaultItems(prefix string, m *config.Mount) []config.Item {
	if _, ok := parsePKIRequest(prefix); !ok {
		return nil
	}
	items := []config.Item{{Key: FileCertificate, Path: FileCertificate}, {Key: FilePrivateKey, Path: FilePrivateKey},
		{Key: FileIssuingCA, Path: FileIssuingCA}, {Key: FileCAChain, Path: FileCAChain}}
	if !m.DefaultModeSet {
		items[1].Mode = 0o600
	}
	return items
}

// minReissue is the shortest time between two issues of one projection,
// whatever the certificates' validity.
const minReissue = time.Second

// followPKI issues the certificate req asks for, and again at two thirds of
// each one's validity (up to a twentieth of it earlier, at random, so that
// many hosts do not ask in step), until ctx is done. Every issue is one
// snapshot: certificate, private_key, issuing_ca and ca_chain switch
// together. A failed issue is retried with the source's backoff, each
// wait at most a quarter of the time the last certificate has left (so
// that it is replaced before it expires), or as soon as the session logs
// in with a new token. A certificate issued with a lease (the role's
// generate_lease) is issued again when the session's token changes, as
// the lease ends with the token, and its lease is revoked when no mount
// follows it any more.
func (s *Source) followPKI(ctx context.Context, req pkiRequest, pub source.Publisher) error {
	bo := newRetryBackoff(s.retryCap())
	var leaseID string
	var notAfter time.Time
	defer func() { s.release(ctx, leaseID, req.role) }()
	for {
		gen, err := s.session.ready(ctx)
		var next time.Duration
		if err == nil {
			var iss issued
			iss, err = s.issue(ctx, req, pub)
			if err != nil {
				err = s.session.check(ctx, gen, err)
			} else {
				leaseID, notAfter, next = iss.leaseID, iss.notAfter, iss.next
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil {
			pub.Status(fmt.Errorf("source %q: issue at %s: %w", s.name, req.role, err))
			next = retryBefore(bo.NextBackOff(), notAfter, time.Now())
			next = s.retryDelay(next)
			s.log.Warn("cannot issue a certificate, keeping the last one", "role", req.role, "common_name", req.commonName, "err", err,
				"retry_in", next.Round(time.Millisecond))
		} else {
			bo.Reset()
		}
		if !s.waitFor(ctx, time.After(next), err != nil || leaseID != "", gen) {
			return ctx.Err()
		}
	}
}

// retryBefore returns wait, shortened to a quarter of the time a
// certificate valid until notAfter has left at now (at least minReissue),
// so that retries come often enough to replace it before it expires. A
// zero notAfter (no certificate yet) leaves wait as it is.
func retryBefore(wait time.Duration, notAfter, now time.Time) time.Duration {
	if notAfter.IsZero() {
		return wait
	}
	return min(wait, max(notAfter.Sub(now)/4, minReissue))
}

// waitFor waits for next or — when onLogin — for a token newer than the
// one of generation gen (the last attempt's: a failed issue may have
// failed for its token, and a lease ends with the token it was taken
// under); it returns false once ctx is done.
func (s *Source) waitFor(ctx context.Context, next <-chan time.Time, onLogin bool, gen uint64) bool {
	for {
		var changed <-chan struct{}
		if onLogin {
			changed = s.session.changes()
			if cur, _, _ := s.session.state(); cur != 0 && cur != gen {
				return true
			}
		}
		select {
		case <-ctx.Done():
			return false
		case <-next:
			return true
		case <-changed:
		}
	}
}

// issued is what one issue gave: the certificate's lease ("" for none),
// its end, and how long until it is issued again.
type issued struct {
	leaseID  string
	notAfter time.Time
	next     time.Duration
}

// issue asks Vault for a certificate and publishes it.
func (s *Source) issue(ctx context.Context, req pkiRequest, pub source.Publisher) (issued, error) {
	data := map[string]any{}
	for k, v := range req.values() {
		data[k] = v[0]
	}
	secret, err := s.client.Logical().WriteWithContext(withPatience(ctx), req.role, data)
	if err != nil {
		return issued{}, describe(err)
	}
	if secret == nil || secret.Data == nil {
		return issued{}, errors.New("the response holds no certificate")
	}
	received := time.Now()
	entries := map[string][]byte{}
	for _, name := range []string{FileCertificate, FilePrivateKey, FileIssuingCA} {
		v, ok := secret.Data[name].(string)
		if !ok || v == "" {
			return issued{}, fmt.Errorf("the response holds no %s", name)
		}
		entries[name] = []byte(v)
	}
	var chain []string
	if list, ok := secret.Data[FileCAChain].([]any); ok {
		for _, c := range list {
			if pemText, ok := c.(string); ok {
				chain = append(chain, pemText)
			}
		}
	}
	entries[FileCAChain] = []byte(strings.Join(chain, "\n"))
	cert, err := parseCertificate(entries[FileCertificate])
	if err != nil {
		return issued{}, err
	}
	validity := cert.NotAfter.Sub(received)
	if validity <= 0 {
		return issued{}, fmt.Errorf("the certificate issued (serial %s) expired at %s", serialOf(secret), cert.NotAfter.UTC().Format(time.RFC3339))
	}
	snap := source.Snapshot{
		Revision: "serial:" + serialOf(secret),
		Entries:  kvset.FromMap(entries),
	}
	tmpl := render.NewSecret(secret.LeaseID, secret.LeaseDuration, secret.Renewable, secret.Data, req.params())
	tmpl.Warnings = secret.Warnings
	snap.Secrets = render.Secrets{req.role: tmpl}
	if lim := pub.Limits(); lim.MaxValueSize > 0 {
		for name, v := range entries {
			if !lim.Keeps(len(v)) {
				return issued{}, fmt.Errorf("the certificate's %s is %d bytes, more than max_value_size (%d bytes)", name, len(v), lim.MaxValueSize)
			}
		}
	}
	// Logged before it is published, so that the log is never behind
	// what a mount has seen.
	next := max(reissueIn(validity), minReissue)
	s.log.Info("issued a certificate", "role", req.role, "common_name", req.commonName, "serial", serialOf(secret),
		"not_after", cert.NotAfter.UTC().Format(time.RFC3339), "reissue_in", next.Round(time.Second))
	pub.Publish(snap)
	return issued{leaseID: secret.LeaseID, notAfter: cert.NotAfter, next: next}, nil
}

// reissueIn returns how long after its receipt a certificate valid for
// validity is issued again: at two thirds of it, up to a twentieth of it
// earlier at random.
func reissueIn(validity time.Duration) time.Duration {
	return validity*2/3 - time.Duration(rand.Int64N(int64(validity/20)+1))
}

// parseCertificate parses the first PEM certificate of data.
func parseCertificate(data []byte) (*x509.Certificate, error) {
	block, _ := pem.Decode(data)
	if block == nil || block.Type != "CERTIFICATE" {
		return nil, errors.New("the response's certificate is not a PEM certificate")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("the response's certificate: %w", err)
	}
	return cert, nil
}

// serialOf returns the issued certificate's serial number, as Vault gives
// it, bounded ("" when absent).
func serialOf(secret *api.Secret) string {
	s, _ := secret.Data["serial_number"].(string)
	if len(s) > 128 {
		s = s[:128]
	}
	return s
}
