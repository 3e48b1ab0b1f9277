package privsep

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
)

// TestMonitorIdentities: each trust domain's worker is given an identity
// of its own when its domain first appears, kept while the domain stays,
// and given back when the domain leaves the configuration or the monitor
// is closed; a configuration whose new domain finds no identity is
// refused before any worker takes it, and what was taken for it is given
// back.
func TestMonitorIdentities(t *testing.T) {
	var mu sync.Mutex
	held := map[string]Identity{}
	refuse := ""
	next := 70000
	m := NewMonitor(MonitorOptions{
		Log: slog.New(slog.DiscardHandler), Kinds: kinds,
		Command: func(string) *exec.Cmd { return exec.Command("/bin/false") },
		Identities: func(domain string) (Identity, func(), error) {
			mu.Lock()
			defer mu.Unlock()
			if domain == refuse {
				return Identity{}, nil, errors.New("no free id")
			}
			next++
			id := Identity{UID: next, GID: next}
			held[domain] = id
			return id, func() {
				mu.Lock()
				defer mu.Unlock()
				delete(held, domain)
			}, nil
		},
	})
	configure := func(names ...string) error {
		var text strings.Builder
		for _, n := range names {
			fmt.Fprintf(&text, "[sources.%s]\ntype = \"etcd\"\nendpoints = [\"http://127.0.0.1:2379\"]\n[[mount]]\nname = \"m%s\"\ndir = \"/srv/%s\"\nsource = %q\n", n, n, n, n)
		}
		cfg, err := config.Parse("/etc/kvmount/kvmount.toml", []byte(text.String()), kinds)
		if err != nil {
			t.Fatal(err)
		}
		return m.Configure(context.Background(), cfg, map[string][]byte{cfg.Path: cfg.Text})
	}
	identities := func() map[string]Identity {
		out := map[string]Identity{}
		for _, w := range m.Workers() {
			out[w.Domain.Name] = w.Supervisor.Identity
		}
		return out
	}
	heldNow := func() map[string]Identity {
		mu.Lock()
		defer mu.Unlock()
		out := map[string]Identity{}
		for k, v := range held {
			out[k] = v
		}
		return out
	}

	// A new domain, refused alongside a new one that was given its own:
	// the configuration is refused, the running one untouched.
	if err := configure("one"); err != nil {
		t.Fatal(err)
	}
	one := identities()["one"]
	refuse = "two"
	err := configure("one", "three", "two")
	if err == nil || !strings.Contains(err.Error(), "domain two: no user for its worker") {
		t.Fatalf("Configure with no identity for two: %v", err)
	}
	if got := identities(); len(got) != 1 || got["one"] != one {
		t.Errorf("workers after the refusal: %+v; want one alone, as %+v", got, one)
	}
	if got := heldNow(); len(got) != 1 {
		t.Errorf("identities held after the refusal: %+v; want one's alone (three's given back)", got)
	}

	// Two domains, two identities; one kept while its domain stays.
	refuse = ""
	if err := configure("one", "two"); err != nil {
		t.Fatal(err)
	}
	got := identities()
	if got["one"] != one || got["two"] == one || got["two"].UID == 0 {
		t.Errorf("identities %+v; want one's kept (%+v) and two's its own", got, one)
	}
	// A domain that leaves gives its identity back.
	if err := configure("two"); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); len(heldNow()) != 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("identities held after one left: %+v; want two's alone", heldNow())
		}
	}
	m.Close()
	if got := heldNow(); len(got) != 0 {
		t.Errorf("identities held after Close: %+v", got)
	}
}
