package config

import (
	"net"
	"net/url"
	"strings"

	"github.com/kvmount/kvmount/origin"
)

// WarnURLCredentials warns at key about the credentials a source or
// webhook URL exposes: user information or a query in the URL itself
// (kvmount redacts them from what it shows, but they sit in the file and
// in the other end's logs), and credentials — sent reports whether the
// entry sends any (a token, a password, headers) — going over http://: in
// clear text to another host, and unauthenticated even on loopback, where
// a local user can take the port. kvmount check prints the warnings; the
// daemon logs them.
func (s *Section) WarnURLCredentials(key, rawURL string, sent bool) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return
	}
	if origin.HasCredentials(rawURL) {
		s.Warnf(key, "%s carries what may be credentials in its URL (user information or a query): kvmount redacts them from its logs and status, but prefer a file only root reads (header_files, token_file, password_file)", origin.Redact(rawURL))
		sent = true
	}
	switch {
	case !sent || !strings.EqualFold(u.Scheme, "http"):
	case isLoopback(u.Hostname()):
		s.Warnf(key, "credentials go to %s over plain TCP (http://): a local user who takes that port while the other end is down, or before it is up, receives them; use https:// with a CA (tls.ca_file)", u.Host)
	default:
		s.Warnf(key, "credentials go to %s in clear text (http://); use https://", u.Host)
	}
}

// isLoopback reports whether host is localhost or a loopback address.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// credentialHeaders are header names whose values are credentials.
var credentialHeaders = []string{"authorization", "proxy-authorization", "cookie"}

// WarnInlineCredentials warns at key about headers whose value is written
// in the configuration file itself and looks like a credential
// (Authorization, Cookie, or a name with token, key, secret or password):
// header_files keeps it in a file only root reads.
func (s *Section) WarnInlineCredentials(key string, headers map[string]string) {
	for name := range headers {
		lower := strings.ToLower(name)
		inline := false
		for _, h := range credentialHeaders {
			inline = inline || lower == h
		}
		for _, part := range []string{"token", "key", "secret", "password", "auth"} {
			inline = inline || strings.Contains(lower, part)
		}
		if inline {
			s.Warnf(key, "header %s holds a credential in the configuration file; put it in header_files, read from a file only root reads", name)
		}
	}
}
