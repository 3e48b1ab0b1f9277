package exepages

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

// TestDropKeepsUprobes places a real uprobe (the kernel's tracefs,
// uprobe_events) on a function of the running test binary after Find, and
// checks that it still fires after a Drop: the kernel wrote its
// breakpoint into a private copy of the page, which a Drop reading smaps
// again leaves mapped.
func TestDropKeepsUprobes(t *testing.T) {
	roottest.Require(t)
	im, err := Find()
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	tracing := tracefs(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	off := fileOffset(t, reflect.ValueOf(probed).Pointer())
	event := fmt.Sprintf("exepages_%d", os.Getpid())
	group := "kvmount_test"
	traceWrite(t, filepath.Join(tracing, "uprobe_events"), fmt.Sprintf("p:%s/%s %s:%#x", group, event, exe, off))
	t.Cleanup(func() {
		_ = os.WriteFile(filepath.Join(tracing, "events", group, event, "enable"), []byte("0"), 0)
		f, err := os.OpenFile(filepath.Join(tracing, "uprobe_events"), os.O_WRONLY|os.O_APPEND, 0)
		if err == nil {
			_, _ = fmt.Fprintf(f, "-:%s/%s\n", group, event)
			f.Close()
		}
	})
	traceWrite(t, filepath.Join(tracing, "events", group, event, "enable"), "1")

	probed(1)
	before := hits(t, tracing, event)
	if before < 1 {
		t.Fatalf("the uprobe did not fire: %d hits", before)
	}
	if err := im.Drop(); err != nil {
		t.Fatal(err)
	}
	probed(2)
	probed(3)
	if after := hits(t, tracing, event); after != before+2 {
		t.Fatalf("the uprobe fired %d times after the drop; want 2 (%d hits before)", after-before, before)
	}
}

// probedSum is what probed adds to, so that its calls are not optimised
// away.
var probedSum int

// probed is the function the uprobe is placed on.
//
//go:noinline
func probed(n int) { probedSum += n }

// tracefs returns where the kernel's tracefs is mounted, mounting it at
// /sys/kernel/tracing for the test when it is not.
func tracefs(t *testing.T) string {
	const dir = "/sys/kernel/tracing"
	if _, err := os.Stat(filepath.Join(dir, "uprobe_events")); err == nil {
		return dir
	}
	if err := unix.Mount("tracefs", dir, "tracefs", 0, ""); err != nil {
		t.Fatalf("mounting tracefs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, 0) })
	if _, err := os.Stat(filepath.Join(dir, "uprobe_events")); err != nil {
		t.Fatalf("the kernel has no uprobes: %v", err)
	}
	return dir
}

// traceWrite appends line to a tracefs control file.
func traceWrite(t *testing.T, path, line string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(line + "\n"); err != nil {
		t.Fatalf("%s: %q: %v", path, line, err)
	}
}

// hits returns how often the uprobe event has fired (uprobe_profile).
func hits(t *testing.T, tracing, event string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(tracing, "uprobe_profile"))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		if len(f) >= 3 && f[1] == event {
			n, err := strconv.Atoi(f[2])
			if err != nil {
				t.Fatalf("uprobe_profile: %q: %v", line, err)
			}
			return n
		}
	}
	t.Fatalf("uprobe_profile has no line for %s:\n%s", event, b)
	return 0
}

// fileOffset returns the offset in the executable's file of the code at
// pc, from the mapping of /proc/self/maps that holds it.
func fileOffset(t *testing.T, pc uintptr) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		f := strings.Fields(line)
		lo, hi, ok := strings.Cut(f[0], "-")
		if !ok || len(f) < 6 {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		off, err3 := strconv.ParseUint(f[2], 16, 64)
		if err := errors.Join(err1, err2, err3); err != nil {
			t.Fatalf("/proc/self/maps: %q: %v", line, err)
		}
		if uint64(pc) >= start && uint64(pc) < end {
			return uint64(pc) - start + off
		}
	}
	t.Fatalf("no mapping holds %#x", pc)
	return 0
}
