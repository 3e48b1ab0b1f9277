package config

import (
	"log/slog"
	"os"
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

// SecretFile reads the file named at key and returns its content as a
// Secret, without the trailing newline; the zero Secret when key is not set.
// An unreadable or empty file is a problem at key's line.
func (s *Section) SecretFile(key string) Secret {
	name := s.String(key, "")
	if name == "" {
		return Secret{}
	}
	data, err := os.ReadFile(name)
	if err != nil {
		s.Errorf(key, "%v", err)
		return Secret{}
	}
	value := strings.TrimRight(string(data), "\r\n")
	if value == "" {
		s.Errorf(key, "%s is empty", name)
	}
	return Secret{value: value}
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

// File returns the path at key after checking that the file can be read;
// "" when key is not set.
func (s *Section) File(key string) string {
	name := s.String(key, "")
	if name == "" {
		return ""
	}
	f, err := os.Open(name)
	if err != nil {
		s.Errorf(key, "%v", err)
		return name
	}
	f.Close()
	return name
}
