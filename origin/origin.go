// Package origin holds the rules for what of a request kvmount sends may
// leave the origin it was configured for: the same-origin redirect policy
// of every HTTP client kvmount runs (the HTTP source, webhooks), and the
// redaction of credentials from URLs before they reach a log line, an
// error, /status or a metric.
package origin

import (
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

// CheckRedirect returns an http.Client CheckRedirect policy for requests
// that carry the headers named (configured headers and header_files, which
// may hold credentials): they go only to the origin of the first request —
// the same scheme, host and port — and a redirect elsewhere is followed
// without them. A redirect from https to http is refused, as it would send
// the request, and what it reveals, in clear text. net/http itself strips
// only Authorization, WWW-Authenticate and Cookie, and only on a redirect
// to another domain.
func CheckRedirect(headers ...string) func(req *http.Request, via []*http.Request) error {
	return func(req *http.Request, via []*http.Request) error {
		if len(via) >= MaxRedirects {
			return fmt.Errorf("stopped after %d redirects", MaxRedirects)
		}
		first := via[0].URL
		if strings.EqualFold(first.Scheme, "https") && !strings.EqualFold(req.URL.Scheme, "https") {
			return fmt.Errorf("refusing a redirect from https to %s (%s)", req.URL.Scheme, Redact(req.URL.String()))
		}
		if Of(req.URL) != Of(first) {
			for _, name := range headers {
				req.Header.Del(name)
			}
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
