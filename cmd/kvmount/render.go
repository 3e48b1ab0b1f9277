package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/kvmount/kvmount/daemon"
	"github.com/kvmount/kvmount/projector"
	"github.com/kvmount/kvmount/untrusted"
)

// render prints the payload of mount as the daemon would write it (see
// daemon.Render): one line per file, "MODE SIZE PATH" with the path
// escaped (a key name is outside text: untrusted.Escape), or with path the
// bytes of that one file, as they are (as cat prints them). It returns 0, or 1 with the error when the
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
		_, _ = stdout.Write(f.Data)
		return exitOK
	}
	for _, p := range payload.Paths() {
		f := payload[p]
		fmt.Fprintf(stdout, "%04o %8d %s\n", f.Mode.Perm(), len(f.Data), untrusted.Escape(p))
	}
	return exitOK
}
