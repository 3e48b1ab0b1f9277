package vault

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/vault/api"

	"github.com/kvmount/kvmount/internal/sourcetest"
	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/internal/vaulttest"
)

// waitLog waits until logs hold n lines with every one of parts.
func waitLog(t *testing.T, logs interface{ Count(...string) int }, n int, parts ...string) {
	t.Helper()
	deadline := time.Now().Add(sourcetest.Timeout)
	for logs.Count(parts...) < n {
		if time.Now().After(deadline) {
			t.Fatalf("fewer than %d log lines with %q after %v", n, parts, sourcetest.Timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// appRole enables AppRole on srv with a role whose tokens live ttl (at
// most maxTTL) and may read secret/*, and writes its role_id and a
// secret_id to files; it returns the [approle] table.
func appRole(t *testing.T, srv *vaulttest.Server, ttl, maxTTL string) string {
	t.Helper()
	srv.Write(t, "sys/auth/approle", map[string]any{"type": "approle"})
	srv.Write(t, "sys/policies/acl/reader", map[string]any{"policy": `path "secret/*" { capabilities = ["read", "list"] }
path "sys/internal/ui/mounts/*" { capabilities = ["read"] }`})
	srv.Write(t, "auth/approle/role/kvmount", map[string]any{"token_policies": "reader", "token_ttl": ttl, "token_max_ttl": maxTTL})
	c := srv.Client(t)
	role, err := c.Logical().Read("auth/approle/role/kvmount/role-id")
	if err != nil {
		t.Fatal(err)
	}
	sid := srv.Write(t, "auth/approle/role/kvmount/secret-id", nil)
	dir := t.TempDir()
	return fmt.Sprintf("[sources.v.approle]\nrole_id_file = %q\nsecret_id_file = %q\n",
		writeFile(t, dir, "role-id", role.Data["role_id"].(string)), writeFile(t, dir, "secret-id", sid.Data["secret_id"].(string)))
}

// loggedIn starts a Vault holding secret/app/db with password, and a
// source that logs in with AppRole (tokens of a 3 s TTL, at most maxTTL)
// and reads every poll; it returns once the source has logged in and its
// follow of secret/app/ holds the password.
func loggedIn(t *testing.T, password, maxTTL, poll string) (*vaulttest.Server, *Source, *testlog.Buffer, *sourcetest.Recorder) {
	t.Helper()
	srv := vaulttest.Start(t)
	srv.Put(t, "secret", "app/db", map[string]any{"password": password})
	table := appRole(t, srv, "3s", maxTTL)
	src, logs := openTest(t, fmt.Sprintf("address = %q\npoll_interval = %q\n%s", srv.URL(), poll, table))
	rec := sourcetest.Follow(t, src, "secret/app/")
	rec.WaitFor(t, "the secret", sourcetest.Holds(map[string]string{"db/password": password}))
	waitLog(t, logs, 1, "logged in to vault", "method=approle")
	return srv, src, logs, rec
}

// TestAppRole logs in with AppRole, renews the token at two thirds of its
// TTL (seen on the server: the token's TTL goes back up), logs in again
// before its maximum TTL and at once when the token is revoked; a token or
// a secret's value never reaches the log or an error.
func TestAppRole(t *testing.T) {
	srv, src, logs, rec := loggedIn(t, "hunter2-value", "9s", "100ms")

	// Renewal: the token's TTL is 3 s; after 4 s it is still valid.
	token := src.client.Token()
	waitLog(t, logs, 1, "renewed the vault token")
	c := srv.Client(t)
	look, err := c.Auth().Token().Lookup(token)
	if err != nil {
		t.Fatalf("the token was not renewed: %v", err)
	}
	if look.Data["last_renewal_time"] == nil {
		t.Errorf("the server saw no renewal: %v", look.Data["last_renewal_time"])
	}

	// The maximum TTL: a new login before it.
	waitLog(t, logs, 2, "logged in to vault", "method=approle")
	if logs.Count("replacing the vault token", "maximum TTL") == 0 {
		t.Errorf("the second login was not for the maximum TTL:\n%s", logs)
	}

	// Revoked: a request finds it, and a new login follows at once.
	logins := logs.Count("logged in to vault")
	if err := c.Auth().Token().RevokeTree(src.client.Token()); err != nil {
		t.Fatal(err)
	}
	srv.Put(t, "secret", "app/db", map[string]any{"password": "after-revoke"})
	rec.WaitFor(t, "the secret after the revocation", sourcetest.Holds(map[string]string{"db/password": "after-revoke"}))
	waitLog(t, logs, logins+1, "logged in to vault")
	if logs.Count("replacing the vault token", "revoked") == 0 {
		t.Errorf("no re-login for the revoked token:\n%s", logs)
	}
	for _, leak := range []string{token, "hunter2-value", "after-revoke"} {
		if strings.Contains(logs.String(), leak) {
			t.Errorf("the log holds %q", leak)
		}
		for _, err := range rec.Errors() {
			if strings.Contains(err.Error(), leak) {
				t.Errorf("error %q holds %q", err, leak)
			}
		}
	}
}

// TestAppRoleRevokedBetweenReads: a token revoked while no read is due is
// found by its renewal, and the log says it was revoked — not that it
// reached its maximum TTL (Vault's lifetime watcher ends without an error
// in both cases).
func TestAppRoleRevokedBetweenReads(t *testing.T) {
	srv, src, logs, _ := loggedIn(t, "p", "1h", "1h")
	if err := srv.Client(t).Auth().Token().RevokeTree(src.client.Token()); err != nil {
		t.Fatal(err)
	}
	waitLog(t, logs, 2, "logged in to vault", "method=approle")
	if logs.Count("replacing the vault token", "revoked") != 1 || logs.Count("maximum TTL") != 0 {
		t.Errorf("the log does not say the token was revoked:\n%s", logs)
	}
}

// TestTokenFile: a token file's token that is revoked is reported, and the
// file is read again until it holds a valid one (a vault-agent sink
// writes the next).
func TestTokenFile(t *testing.T) {
	srv := vaulttest.Start(t)
	srv.Put(t, "secret", "app/db", map[string]any{"password": "p"})
	c := srv.Client(t)
	child := func() string {
		s, err := c.Auth().Token().Create(&api.TokenCreateRequest{Policies: []string{"root"}, TTL: "1h"})
		if err != nil {
			t.Fatal(err)
		}
		return s.Auth.ClientToken
	}
	first := child()
	file := writeFile(t, t.TempDir(), "token", first)
	src, logs := openTest(t, fmt.Sprintf("address = %q\ntoken_file = %q\npoll_interval = \"100ms\"\n", srv.URL(), file))
	rec := sourcetest.Follow(t, src, "secret/app/")
	rec.WaitFor(t, "the secret", sourcetest.Holds(map[string]string{"db/password": "p"}))
	if err := c.Auth().Token().RevokeOrphan(first); err != nil {
		t.Fatal(err)
	}
	rec.WaitFor(t, "the failure", sourcetest.Failing)
	waitLog(t, logs, 1, "vault login failed", "is not valid")
	if err := os.WriteFile(file, []byte(child()), 0o600); err != nil {
		t.Fatal(err)
	}
	srv.Put(t, "secret", "app/db", map[string]any{"password": "q"})
	rec.WaitFor(t, "the new token's read", sourcetest.Holds(map[string]string{"db/password": "q"}))
	rec.WaitFor(t, "health", sourcetest.Healthy)
	if strings.Contains(logs.String(), first) {
		t.Error("the log holds the token")
	}
}
