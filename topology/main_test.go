package topology

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// kvmountBin is the daemon binary, built once by TestMain with the race
// detector.
var kvmountBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "kvmount-topology")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	kvmountBin = filepath.Join(dir, "kvmount")
	build := exec.Command("go", "build", "-race", "-o", kvmountBin, "github.com/kvmount/kvmount/cmd/kvmount")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building kvmount:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}
