package config

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
)

// TLS is a source's tls = { ... } table: files in PEM, read when the
// configuration is loaded (at start and at each reload) by the rules of
// credential files — without following a symlink in any component,
// without blocking (a FIFO is refused at once), a regular file of bounded
// size — so that no file someone else controls can hang, redirect or
// exhaust kvmount.
type TLS struct {
	// CAFile holds the certificates that verify the server; empty means
	// the system's roots. CA is its content.
	CAFile string
	CA     []byte
	// CertFile and KeyFile are the client certificate and key, both or
	// neither; Cert and Key their content.
	CertFile, KeyFile string
	Cert              []byte
	Key               Secret
	// ServerName overrides the name checked in the server's certificate.
	ServerName string
}

// tlsFileLimit is the largest certificate file read, in bytes.
const tlsFileLimit = 1 << 20

// Enabled reports whether any TLS setting is present.
func (t TLS) Enabled() bool {
	return t.CAFile != "" || t.CertFile != "" || t.KeyFile != "" || t.ServerName != ""
}

// Config returns a client configuration (TLS 1.2 or later) with t's
// roots, client certificate and server name, from the content read at
// load. It returns an error when CA holds no certificate or the pair does
// not parse.
func (t TLS) Config() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName}
	if t.CAFile != "" {
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(t.CA) {
			return nil, fmt.Errorf("tls: no certificate in %s", t.CAFile)
		}
	}
	if t.CertFile != "" {
		cert, err := tls.X509KeyPair(t.Cert, []byte(t.Key.Reveal()))
		if err != nil {
			return nil, fmt.Errorf("tls: %s and %s: %w", t.CertFile, t.KeyFile, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// TLS decodes the table at key as TLS settings and reads its files (see
// TLS): a missing, unreadable, too large file, a symlink in its path or
// anything but a regular file is a problem at its line; a key_file others
// can read, or that a user other than root owns, is a warning, as for
// every credential file (SecretFile). cert_file and key_file go together.
func (s *Section) TLS(key string) TLS {
	sec := s.Table(key)
	defer sec.Done()
	t := TLS{ServerName: sec.String("server_name", "")}
	t.CAFile, t.CA = sec.pemFile("ca_file")
	t.CertFile, t.Cert = sec.pemFile("cert_file")
	t.KeyFile, t.Key = sec.String("key_file", ""), sec.SecretFile("key_file")
	if (t.CertFile == "") != (t.KeyFile == "") {
		sec.Errorf("", "cert_file and key_file go together")
	}
	return t
}

// pemFile reads the certificate file named at key (see TLS).
func (s *Section) pemFile(key string) (string, []byte) {
	name := s.String(key, "")
	if name == "" {
		return "", nil
	}
	data, _, err := s.doc.files.Read(name, tlsFileLimit)
	if err != nil {
		s.Errorf(key, "%v", err)
		return name, nil
	}
	if len(data) == 0 {
		s.Errorf(key, "%v", errors.New(name+" is empty"))
	}
	return name, data
}
