package config

import (
	"fmt"
	"log/slog"
	"strings"
)

// Secret is a credential read from a file (a password, a token, a header
// value). It prints as "[redacted]" in logs, errors and %v, so that a value
// never reaches them; Reveal returns it.
type Secret struct{ value string }

// Reveal returns the secret's value.
func (s Secret) Reveal() string { return s.value }

// IsZero reports whether the secret is empty.
func (s Secret) IsZero() bool { return s.value == "" }

// String returns "[redacted]", or "" for an empty secret.
func (s Secret) String() string {
	if s.value == "" {
		return ""
	}
	return "[redacted]"
}

// GoString is String, for %#v.
func (s Secret) GoString() string { return s.String() }

// LogValue is String, for log/slog.
func (s Secret) LogValue() slog.Value { return slog.StringValue(s.String()) }

// secretFileLimit is the largest credential file read, in bytes.
const secretFileLimit = 64 << 10

// SecretFile reads the file named at key and returns its content as a
// Secret, without the trailing newline; the zero Secret when key is not set.
// An unreadable, empty or larger than 64 KiB file, or a symlink in its path,
// is a problem at key's line: it is opened without following a symlink in
// any component. A file that users other than its owner can read, or that
// a user other than root owns (who could change it), is a warning there.
func (s *Section) SecretFile(key string) Secret {
	name := s.String(key, "")
	if name == "" {
		return Secret{}
	}
	data, st, err := s.doc.files.Read(name, secretFileLimit)
	if err != nil {
		s.Errorf(key, "%v", err)
		return Secret{}
	}
	value := strings.TrimRight(string(data), "\r\n")
	if value == "" {
		s.Errorf(key, "%s is empty", name)
	}
	switch {
	case st.Mode&0o044 != 0:
		s.Warnf(key, "%s holds a credential and is readable by %s (mode %04o); chmod go-r it", name, readers(st.Mode), st.Mode&0o7777)
	case st.Uid != 0:
		s.Warnf(key, "%s holds a credential and is owned by uid %d, who can change it; chown it to root", name, st.Uid)
	}
	return Secret{value: value}
}

// ReadSecretFile reads the credential file name as SecretFile does (without
// following a symlink in any component, without blocking, at most 64 KiB,
// the trailing newline dropped), for a source that reads it again while it
// runs, such as a token a vault-agent sink rotates. It returns an error for
// an unreadable, empty, too large or non-regular file; the error names the
// file, never its content.
func ReadSecretFile(name string) (Secret, error) {
	return ReadSecretFileFrom(Disk{}, name)
}

// ReadSecretFileFrom is ReadSecretFile reading through files.
func ReadSecretFileFrom(files Files, name string) (Secret, error) {
	data, _, err := files.Read(name, secretFileLimit)
	if err != nil {
		return Secret{}, err
	}
	value := strings.TrimRight(string(data), "\r\n")
	if value == "" {
		return Secret{}, fmt.Errorf("%s is empty", name)
	}
	return Secret{value: value}, nil
}

// readers names who besides the owner may read a file of mode.
func readers(mode uint32) string {
	if mode&0o004 != 0 {
		return "every user"
	}
	return "its group"
}

// SecretFileMap reads the table at key, such as header_files = {
// Authorization = "/etc/kvmount/token" }, and returns each name with the
// content of its file as a Secret (see SecretFile); nil when key is not
// set.
func (s *Section) SecretFileMap(key string) map[string]Secret {
	if !s.Has(key) {
		return nil
	}
	files := s.Table(key)
	defer files.Done()
	out := map[string]Secret{}
	for _, name := range files.Keys() {
		out[name] = files.SecretFile(name)
	}
	return out
}
