package vault

import (
	"testing"
	"time"

	consulapi "github.com/hashicorp/consul/api"

	"github.com/kvmount/kvmount/internal/consultest"
	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/vaulttest"
	"github.com/kvmount/kvmount/source"
)

// consulManagement is the management token of the Consul agent the lease
// tests start.
const consulManagement = "7e0a3b62-95c4-4b8c-9d6b-6f1e4b0c2a11"

// consulCreds starts a Consul agent with ACLs and mounts Vault's Consul
// secrets engine on srv with the role app, whose tokens' leases last ttl
// (renewable up to maxTTL): a real dynamic secret with a renewable lease.
// It returns the agent's client with the management token.
func consulCreds(t *testing.T, srv *vaulttest.Server, ttl, maxTTL string) *consulapi.Client {
	t.Helper()
	agent := consultest.Start(t, "-hcl", `acl { enabled = true
default_policy = "allow"
tokens { initial_management = "`+consulManagement+`" } }`)
	c, err := consulapi.NewClient(&consulapi.Config{Address: agent.Addr(), Scheme: "http", Token: consulManagement})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.ACL().PolicyCreate(&consulapi.ACLPolicy{Name: "kv-read", Rules: `key_prefix "" { policy = "read" }`}, nil); err != nil {
		t.Fatal(err)
	}
	srv.Write(t, "sys/mounts/consul", map[string]any{"type": "consul"})
	srv.Write(t, "consul/config/access", map[string]any{"address": agent.Addr(), "token": consulManagement})
	srv.Write(t, "consul/roles/app", map[string]any{"consul_policies": "kv-read", "ttl": ttl, "max_ttl": maxTTL})
	return c
}

// TestLeaseRenewedAndReadAgain: a dynamic secret's renewable lease is
// renewed at two thirds of its duration (the server's lease shows the
// renewal), the secret is read again before the lease's maximum TTL (new
// credentials), and the lease is revoked when no mount follows it any
// more — the Consul token it made is gone.
func TestLeaseRenewedAndReadAgain(t *testing.T) {
	srv := vaulttest.Start(t)
	consul := consulCreds(t, srv, "3s", "10s")
	src, logs := tokenSource(t, srv, "")
	rec, stop := sourcetest.FollowStoppable(t, src, "consul/creds/app", source.Limits{})
	rec.WaitFor(t, "the credentials", func(snaps []source.Snapshot, _ error) bool {
		return len(snaps) > 0 && len(snaps[0].Entries.ValueOf("token")) > 0
	})
	first := mustSnaps(rec)[0]
	lease := first.Secrets["consul/creds/app"]
	if lease == nil || lease.LeaseID == "" || !lease.Renewable {
		t.Fatalf("no renewable lease: %+v", lease)
	}
	// Renewed: the server records the renewal.
	deadline := time.Now().Add(sourcetest.Timeout)
	for {
		s, err := srv.Client(t).Sys().Lookup(lease.LeaseID)
		if err == nil && s != nil && s.Data["last_renewal"] != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("lease %s never renewed (lookup: %v, %v)", lease.LeaseID, s, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Read again before the maximum TTL: new credentials, while the first
	// ones still work.
	rec.WaitFor(t, "new credentials", func(snaps []source.Snapshot, _ error) bool {
		return len(snaps) > 1 && string(snaps[len(snaps)-1].Entries.ValueOf("accessor")) != string(first.Entries.ValueOf("accessor"))
	})
	second := sourcetest.Last(mustSnaps(rec))
	if _, _, err := consul.ACL().TokenRead(string(first.Entries.ValueOf("accessor")), nil); err != nil {
		t.Errorf("the first credentials were gone before their lease's end: %v", err)
	}
	if logs.Count("reading a leased secret again", "path=consul/creds/app") == 0 {
		t.Errorf("the new read was not logged:\n%s", logs)
	}
	// Released: revoked, and Consul's token with it.
	stop(source.ErrReleased)
	if _, err := srv.Client(t).Sys().Lookup(second.Secrets["consul/creds/app"].LeaseID); err == nil {
		t.Error("the lease outlived the release")
	}
	if tok, _, err := consul.ACL().TokenRead(string(second.Entries.ValueOf("accessor")), nil); err == nil && tok != nil {
		t.Error("the Consul token outlived the release")
	}
}
