package fsutil

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// The extended attributes that hold a file's POSIX ACLs (acl(5)): the
// access ACL, and a directory's default ACL, which new entries in it
// inherit as their own access (and, for directories, default) ACL.
const (
	ACLAccessXattr  = "system.posix_acl_access"
	ACLDefaultXattr = "system.posix_acl_default"
)

// StripACL removes the POSIX access ACL of the open file f and, for a
// directory, its default ACL, so that f carries exactly its owner and
// permission bits, and what is created in it inherits nothing. A file
// system without ACLs, or a file without them, is no error.
//
// Without it, a default ACL on a mount directory that someone else created
// (setfacl -d -m u:them:rwx) is inherited by every version directory and
// file kvmount writes there; a chmod to 0440 then sets only the ACL mask,
// and the named user still reads the secret.
func StripACL(f *os.File) error {
	for _, name := range []string{ACLDefaultXattr, ACLAccessXattr} {
		err := unix.Fremovexattr(int(f.Fd()), name)
		if err != nil && !errors.Is(err, unix.ENODATA) && !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("%s: remove %s: %w", f.Name(), name, err)
		}
	}
	return nil
}

// MayHaveDefaultACL reports whether the open directory d has a default
// ACL, or might have: false only when the kernel says it has none
// (ENODATA), or that its file system keeps no ACLs (EOPNOTSUPP).
func MayHaveDefaultACL(d *os.File) bool {
	_, err := unix.Fgetxattr(int(d.Fd()), ACLDefaultXattr, nil)
	return !errors.Is(err, unix.ENODATA) && !errors.Is(err, unix.EOPNOTSUPP)
}

// ACL entry tags and the permission bit for writing (linux/posix_acl.h,
// include/uapi/linux/posix_acl_xattr.h).
const (
	aclXattrVersion = 2
	aclUser         = 0x02
	aclGroup        = 0x08
	aclMask         = 0x10
	aclWrite        = 0x02
)

// ACLWriters returns the user and group IDs that the access ACL of the open
// file f grants write permission to by name (ACL_USER and ACL_GROUP entries
// whose permission the ACL mask does not take away); nil when it has no
// access ACL. users and groups are numeric IDs.
func ACLWriters(f *os.File) (users, groups []uint32, err error) {
	buf := make([]byte, 4096)
	n, err := unix.Fgetxattr(int(f.Fd()), ACLAccessXattr, buf)
	if errors.Is(err, unix.ENODATA) || errors.Is(err, unix.EOPNOTSUPP) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("%s: read %s: %w", f.Name(), ACLAccessXattr, err)
	}
	return parseACLWriters(buf[:n])
}

// parseACLWriters parses a posix_acl_xattr value: a little-endian u32
// version, then entries of u16 tag, u16 permission and u32 ID.
func parseACLWriters(b []byte) (users, groups []uint32, err error) {
	if len(b) < 4 || binary.LittleEndian.Uint32(b) != aclXattrVersion || (len(b)-4)%8 != 0 {
		return nil, nil, errors.New("malformed POSIX ACL")
	}
	maskWrites := true
	type entry struct {
		tag, perm uint16
		id        uint32
	}
	var named []entry
	for e := b[4:]; len(e) >= 8; e = e[8:] {
		tag, perm, id := binary.LittleEndian.Uint16(e), binary.LittleEndian.Uint16(e[2:]), binary.LittleEndian.Uint32(e[4:])
		switch tag {
		case aclMask:
			maskWrites = perm&aclWrite != 0
		case aclUser, aclGroup:
			named = append(named, entry{tag, perm, id})
		}
	}
	if !maskWrites {
		return nil, nil, nil
	}
	for _, e := range named {
		if e.perm&aclWrite == 0 {
			continue
		}
		if e.tag == aclUser {
			users = append(users, e.id)
		} else {
			groups = append(groups, e.id)
		}
	}
	return users, groups, nil
}
