package etcd

import (
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/kvmount/kvmount/config"
)

// Config is a decoded [sources.NAME] table of type "etcd".
type Config struct {
	// Endpoints are client URLs: http://, https://, unix:// or unixs://.
	Endpoints []string
	// DialTimeout bounds connecting and authenticating.
	DialTimeout time.Duration
	// Username and Password authenticate; Password is read from
	// password_file.
	Username string
	Password config.Secret
	// TLS configures https:// endpoints.
	TLS config.TLS
	// ChangeDetection is Watch or Poll.
	ChangeDetection string
	// PollInterval is the period of Poll.
	PollInterval time.Duration
	// PeerUID, when ≥ 0, is the user etcd must run as (peer_user): every
	// connection, over a unix socket or TCP on loopback, is checked
	// (peercred), so that a local user who takes etcd's port while it is
	// down feeds nothing. -1 checks nothing.
	PeerUID int
}

// PlainTCP returns the endpoints reached over plain TCP without a
// peer_user check (config.PlainTCP).
func (c *Config) PlainTCP() []string {
	if c.PeerUID >= 0 {
		return nil
	}
	var out []string
	for _, ep := range c.Endpoints {
		if strings.HasPrefix(ep, "http://") {
			out = append(out, ep)
		}
	}
	return out
}

// StoreURLs returns the URLs the source connects to (config.StoreURLs).
func (c *Config) StoreURLs() []string {
	return slices.Clone(c.Endpoints)
}

// Decode reads a [sources.NAME] table of type "etcd", reporting problems
// through sec. It returns a *Config.
func Decode(sec *config.Section) any {
	c := &Config{
		Endpoints:       sec.Strings("endpoints"),
		DialTimeout:     sec.Duration("dial_timeout", DefaultDialTimeout),
		Username:        sec.String("username", ""),
		Password:        sec.SecretFile("password_file"),
		TLS:             sec.TLS("tls"),
		ChangeDetection: sec.Choice("change_detection", Watch, Watch, Poll),
		PollInterval:    sec.DurationAtLeast("poll_interval", DefaultPollInterval, config.MinPollInterval),
		PeerUID:         sec.UserID("peer_user"),
	}
	if !sec.Has("endpoints") {
		c.Endpoints = []string{DefaultEndpoint}
	} else if len(c.Endpoints) == 0 {
		sec.Errorf("endpoints", "needs at least one endpoint")
	}
	for _, ep := range c.Endpoints {
		u, err := url.Parse(ep)
		switch {
		case err != nil:
			sec.Errorf("endpoints", "%q: want a URL with scheme http, https, unix or unixs, such as %q", ep, DefaultEndpoint)
		case u.Scheme != "http" && u.Scheme != "https" && u.Scheme != "unix" && u.Scheme != "unixs":
			sec.Errorf("endpoints", "%q: want a URL with scheme http, https, unix or unixs", ep)
		case u.Host == "" && u.Path == "":
			sec.Errorf("endpoints", "%q has no host", ep)
		}
	}
	if (c.Username == "") != c.Password.IsZero() {
		sec.Errorf("username", "username and password_file go together")
	}
	for _, ep := range c.Endpoints {
		sec.WarnURLCredentials("endpoints", ep, c.Username != "")
	}
	return c
}
