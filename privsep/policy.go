package privsep

import (
	"fmt"
	"maps"
	"net"
	"net/url"
	"slices"
	"strconv"

	"github.com/kvmount/kvmount/config"
)

// Files and directories every worker reads: Go's resolver's
// (resolv.conf, with systemd-resolved's stub beside it, hosts,
// nsswitch.conf) and the system's CA certificates where Go's crypto/x509
// looks for them on Linux, with the trees their symlinks point into.
var (
	baseFiles = []string{"/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/host.conf", "/etc/services"}
	baseDirs  = []string{"/etc/ssl", "/etc/pki", "/usr/share/ca-certificates", "/usr/local/share/ca-certificates", "/run/systemd/resolve"}
)

// dnsPort is where a worker's resolver sends its queries (RFC 1035).
const dnsPort = 53

// PolicyFor returns the policy of the worker that follows cfg's sources
// and delivers its mounts' webhooks: the resolver's and CA certificates'
// files, the TCP port of every store and webhook URL (its explicit port,
// else 80 for http and 443 for https), the socket of a unix:// or
// unixs:// endpoint, and port 53 over TCP and UDP when a URL names a host
// that is not an IP address or localhost. It returns an error for a URL
// it cannot read.
func PolicyFor(cfg *config.Config) (Policy, error) {
	p := Policy{ReadFiles: slices.Clone(baseFiles), ReadDirs: slices.Clone(baseDirs)}
	dns := false
	for _, name := range slices.Sorted(maps.Keys(cfg.Sources)) {
		src := cfg.Sources[name]
		urls, ok := src.Settings.(config.StoreURLs)
		if !ok {
			return Policy{}, fmt.Errorf("source %q (%s) does not say what it connects to", name, src.Type)
		}
		for _, raw := range urls.StoreURLs() {
			if err := p.allow(raw, &dns); err != nil {
				return Policy{}, fmt.Errorf("source %q: %w", name, err)
			}
		}
	}
	for _, m := range cfg.Mounts {
		for _, n := range m.Notify {
			if n.Webhook == "" {
				continue
			}
			if err := p.allow(n.Webhook, &dns); err != nil {
				return Policy{}, fmt.Errorf("mount %q: webhook: %w", m.Name, err)
			}
		}
	}
	if dns {
		p.ConnectTCP = appendNew(p.ConnectTCP, dnsPort)
		p.SendUDP = appendNew(p.SendUDP, dnsPort)
	}
	return p, nil
}

// allow adds what reaching raw takes to p: its unix socket, or its TCP
// port; dns is set when it names a host to resolve.
func (p *Policy) allow(raw string, dns *bool) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("%q: %w", raw, err)
	}
	if u.Scheme == "unix" || u.Scheme == "unixs" {
		p.UnixSockets = appendNew(p.UnixSockets, u.Host+u.Path)
		return nil
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return fmt.Errorf("%q: no TCP port", raw)
	}
	p.ConnectTCP = appendNew(p.ConnectTCP, uint16(n))
	if host := u.Hostname(); host != "localhost" && net.ParseIP(host) == nil {
		*dns = true
	}
	return nil
}

// appendNew appends v to s unless s holds it.
func appendNew[T comparable](s []T, v T) []T {
	if slices.Contains(s, v) {
		return s
	}
	return append(s, v)
}
