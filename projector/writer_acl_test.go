package projector

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/fsutil"
	"github.com/kvmount/kvmount/internal/roottest"
)

// TestHelperProcess is the body of roottest.User.Helper's commands.
func TestHelperProcess(t *testing.T) {
	roottest.RunHelper(map[string]func() error{
		// Give $DIR, a directory the user owns, a default ACL that
		// grants user $ID everything, as setfacl -d -m u:$ID:rwx would.
		"set-default-acl": func() error {
			id, err := strconv.ParseUint(os.Getenv("ID"), 10, 32)
			if err != nil {
				return err
			}
			return unix.Setxattr(os.Getenv("DIR"), roottest.ACLXattr(true), roottest.ACLValue(grantAll(uint32(id))...), 0)
		},
	})
}

// grantAll is an ACL that grants user id, and everyone, everything.
func grantAll(id uint32) []roottest.ACLEntry {
	return []roottest.ACLEntry{{Tag: roottest.ACLUserObj, Perm: 7}, {Tag: roottest.ACLUser, Perm: 7, ID: id},
		{Tag: roottest.ACLGroupObj, Perm: 7}, {Tag: roottest.ACLMask, Perm: 7}, {Tag: roottest.ACLOther, Perm: 7}}
}

// assertSecretKept fails t when the current version of the mount dir, or
// its db directory or db/password file, carries an access or a default
// ACL, or when u reads the secret ("s3cret") there.
func assertSecretKept(t *testing.T, dir string, u roottest.User) {
	t.Helper()
	version, err := os.Readlink(filepath.Join(dir, DataDirName))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{version, filepath.Join(version, "db"), filepath.Join(version, "db", "password")} {
		for _, name := range []string{fsutil.ACLAccessXattr, fsutil.ACLDefaultXattr} {
			if _, err := syscall.Getxattr(filepath.Join(dir, p), name, make([]byte, 256)); err == nil {
				t.Errorf("%s carries %s", p, name)
			}
		}
	}
	out, err := u.Command("cat", filepath.Join(dir, "db", "password")).CombinedOutput()
	if err == nil || strings.Contains(string(out), "s3cret") {
		t.Errorf("%s read the secret: %q, %v", u.Name, out, err)
	}
}

// TestVersionsDropADefaultACLTheOwnerAddsLater: the user who owns a mount
// directory gives it, after kvmount opened it, a default ACL that would
// let them read the root-only secret of every version written there from
// then on. The next version inherits none of it, and the user reads
// nothing. (The writer skips the removal only for a directory of its own
// user that had no default ACL: no one else can add one.)
func TestVersionsDropADefaultACLTheOwnerAddsLater(t *testing.T) {
	u := roottest.NewUser(t)
	dir := filepath.Join(roottest.TempDir(t), "secrets")
	md, err := (Medium{Dir: dir, Mode: 0o755, UID: u.UID, GID: u.GID}).Prepare(Owner{}, "", noRecord)
	if err != nil {
		t.Fatal(err)
	}
	defer md.File.Close()
	w, err := OpenAtomicWriterAt(dir, md.File, WriterOptions{ManifestDir: manifestDir(t, dir), DirMode: 0o755, DirUID: u.UID, DirGID: u.GID})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	secret := func(v string) Payload {
		return Payload{"db/password": {Data: []byte(v), Mode: 0o440, UID: 0, GID: 0}}
	}
	if _, err := w.Write(secret("before")); err != nil {
		t.Fatal(err)
	}
	if out, err := u.Helper(t, "set-default-acl", "DIR="+dir, "ID="+strconv.Itoa(u.UID)).CombinedOutput(); err != nil {
		t.Fatalf("the owner could not set a default ACL: %v: %s", err, out)
	}
	if _, err := w.Write(secret("s3cret")); err != nil {
		t.Fatal(err)
	}
	assertSecretKept(t, dir, u)
}

// TestVersionsDropADefaultACLOfTheirOwnMountDirectory: a directory of
// root's with a default ACL when the writer opens it (not taken over by
// Prepare, which would remove it) passes none of it on to the versions.
func TestVersionsDropADefaultACLOfTheirOwnMountDirectory(t *testing.T) {
	u := roottest.NewUser(t)
	dir := filepath.Join(roottest.TempDir(t), "secrets")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	roottest.SetACL(t, dir, true, grantAll(uint32(u.UID))...)
	w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(t, dir), DirMode: 0o755, DirUID: 0, DirGID: 0})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	for _, v := range []string{"first", "s3cret"} {
		if _, err := w.Write(Payload{"db/password": {Data: []byte(v), Mode: 0o440, UID: 0, GID: 0}}); err != nil {
			t.Fatal(err)
		}
	}
	assertSecretKept(t, dir, u)
}
