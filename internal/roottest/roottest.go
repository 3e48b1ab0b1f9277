// Package roottest is for tests that need root: mounting tmpfs, changing
// owners. The development machines and CI run as root.
package roottest

import (
	"bufio"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// Require skips the test when not running as root — or fails it when
// CI=true, where the machine runs as root and a skip would hide the test.
func Require(tb testing.TB) {
	tb.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		tb.Fatal("this test needs root, and CI runs as root")
	}
	tb.Skip("this test needs root")
}

// MountsAt counts the mounts whose mount point is dir, from
// /proc/self/mountinfo.
func MountsAt(tb testing.TB, dir string) int {
	tb.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 4 && fields[4] == dir {
			n++
		}
	}
	return n
}

// UnmountAtEnd makes sure nothing stays mounted at dir when the test ends.
func UnmountAtEnd(tb testing.TB, dir string) {
	tb.Cleanup(func() {
		for MountsAt(tb, dir) > 0 {
			if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
				tb.Errorf("unmount %s: %v", dir, err)
				return
			}
		}
	})
}
