package config

// TLS is a source's tls = { ... } table: files in PEM.
type TLS struct {
	// CAFile holds the certificates that verify the server; empty means
	// the system's roots.
	CAFile string
	// CertFile and KeyFile are the client certificate and key, both or
	// neither.
	CertFile, KeyFile string
	// ServerName overrides the name checked in the server's certificate.
	ServerName string
}

// Enabled reports whether any TLS setting is present.
func (t TLS) Enabled() bool { return t != TLS{} }

// TLS decodes the table at key as TLS settings, checking that the files can
// be read and that cert_file and key_file come together.
func (s *Section) TLS(key string) TLS {
	sec := s.Table(key)
	defer sec.Done()
	t := TLS{
		CAFile:     sec.File("ca_file"),
		CertFile:   sec.File("cert_file"),
		KeyFile:    sec.File("key_file"),
		ServerName: sec.String("server_name", ""),
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		sec.Errorf("", "cert_file and key_file go together")
	}
	return t
}
