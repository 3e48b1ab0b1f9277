// Package origin holds the rules for what of a request kvmount sends may
// leave the origin it was configured for: the same-origin redirect policy
// of every HTTP client kvmount runs (the HTTP source, webhooks), and the
// redaction of credentials from URLs before they reach a log line, an
// error, /status or a metric.
package origin

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// Of returns scheme://host:port of u, lower-cased, with the scheme's
// default port made explicit, so that "https://h" and "https://h:443" are
// one origin (RFC 6454 §4).
func Of(u *url.URL) string {
	port := u.Port()
	if port == "" {
		switch strings.ToLower(u.Scheme) {
		case "http":
			port = "80"
		case "https":
			port = "443"
		}
	}
	return strings.ToLower(u.Scheme) + "://" + strings.ToLower(u.Hostname()) + ":" + port
}

// MaxRedirects is how many redirects one request follows, as net/http's
// default policy.
const MaxRedirects = 10

// ErrOtherOrigin is wrapped by the error of a request redirected to
// another origin than the configured one.
var ErrOtherOrigin = errors.New("redirected to another origin")

// CheckRedirect returns an http.Client CheckRedirect policy for the
// requests of an HTTP source and of webhooks: a redirect is followed
// within the origin of the first request only — the same scheme, host and
// port —, with the configured headers (headers and header_files, which may
// hold credentials: they never leave the origin). A redirect to another origin is refused with an error
// wrapping ErrOtherOrigin that names where it led (redacted) and says to
// configure that URL instead: the worker that sends these requests may
// reach only the ports its configuration names (Landlock), a redirect
// elsewhere would fail there anyway, and following one would hand a
// server's choice of destination what the configuration did not name.
// (net/http itself strips only Authorization, WWW-Authenticate and
// Cookie, and only on a redirect to another domain.)
func CheckRedirect() func(req *http.Request, via []*http.Request) error {
	return func(req *http.Request, via []*http.Request) error {
		if len(via) >= MaxRedirects {
			return fmt.Errorf("stopped after %d redirects", MaxRedirects)
		}
		if first := via[0].URL; Of(req.URL) != Of(first) {
			return fmt.Errorf("%w: %s leads to %s; kvmount follows a redirect within the configured origin (scheme, host and port) only: configure that URL instead",
				ErrOtherOrigin, Redact(first.String()), Redact(req.URL.String()))
		}
		return nil
	}
}

// redacted replaces a credential in a URL.
const redacted = "redacted"

// Redact returns raw with whatever may be a credential replaced: the
// whole user information (a token is often the user name alone, as in
// https://TOKEN@host/), every query value (?token=...) and the fragment.
// Scheme, host, port, path and query names stay, for an operator to
// recognise the URL. An unparsable URL becomes "(unparsable URL)".
func Redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	if u.User != nil {
		u.User = url.User(redacted)
	}
	if u.RawQuery != "" {
		q := u.Query()
		for name, values := range q {
			for i := range values {
				values[i] = redacted
			}
			q[name] = values
		}
		u.RawQuery = q.Encode()
	}
	if u.Fragment != "" {
		u.Fragment, u.RawFragment = redacted, ""
	}
	return u.String()
}

// HasCredentials reports whether raw carries user information or a query
// (where tokens travel), for kvmount check's warnings.
func HasCredentials(raw string) bool {
	u, err := url.Parse(raw)
	return err == nil && (u.User != nil || u.RawQuery != "")
}
