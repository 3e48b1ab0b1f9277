package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/daemon"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/untrusted"
)

// render prints the payload of mount as the daemon would write it (see
// daemon.Render): one line per file, "MODE SIZE PATH" with the path
// escaped (a key name is outside text: untrusted.Escape), or with path the
// bytes of that one file: escaped as well on a terminal, as they are when
// piped or redirected (as cat prints them). It returns 0, or 1 with the error when the
// payload cannot be built, and 2 for a usage error.
func render(ctx context.Context, opts daemon.Options, mount, path string, timeout time.Duration, stdout, stderr io.Writer) int {
	if mount == "" {
		fmt.Fprintln(stderr, "kvmount render: -mount NAME is required")
		return exitUsage
	}
	payload, err := daemon.Render(ctx, opts, mount, timeout)
	if err != nil {
		fmt.Fprintln(stderr, untrusted.Escape(err.Error()))
		return exitFailure
	}
	if path != "" {
		clean, err := projector.CleanPath(path)
		if err != nil {
			fmt.Fprintln(stderr, err)
			return exitUsage
		}
		f, ok := payload[clean]
		if !ok {
			fmt.Fprintf(stderr, "kvmount render: mount %q has no file %q\n", mount, clean)
			return exitFailure
		}
		if terminal(stdout) {
			// A store writer's escape sequences never reach a terminal;
			// piped or redirected, the bytes are the file's, as cat's.
			fmt.Fprintln(stdout, untrusted.Escape(string(f.Data)))
			return exitOK
		}
		_, _ = stdout.Write(f.Data)
		return exitOK
	}
	for _, p := range payload.Paths() {
		f := payload[p]
		fmt.Fprintf(stdout, "%04o %8d %s\n", f.Mode.Perm(), len(f.Data), untrusted.Escape(p))
	}
	return exitOK
}

// terminal reports whether w is a terminal (a TTY: the TCGETS ioctl
// answers), where outside text is escaped.
func terminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
