//go:build !amd64

package escapetest

// i386Attempts are none on an architecture without an i386 entry.
func i386Attempts() map[string]func() error {
	return map[string]func() error{"native io_uring_setup": ioUringSetup}
}
