package packaging

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// promtool returns Prometheus's promtool: $KVMOUNT_PROMTOOL, promtool on
// $PATH, or the one in Debian's prometheus package, downloaded (not
// installed: the package would start a Prometheus server) and extracted
// once into ~/.cache/kvmount/. With CI=true a failure is fatal.
func promtool(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv("KVMOUNT_PROMTOOL"); bin != "" {
		return bin
	}
	if bin, err := exec.LookPath("promtool"); err == nil {
		return bin
	}
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache")
	}
	dir := filepath.Join(cache, "kvmount", "promtool-debian")
	bin := filepath.Join(dir, "usr", "bin", "promtool")
	if _, err := os.Stat(bin); err == nil {
		return bin
	}
	work := t.TempDir()
	get := "apt-get download prometheus || { apt-get update -qq && apt-get download prometheus; }"
	fail := t.Skipf
	if os.Getenv("CI") == "true" {
		fail = t.Fatalf
	}
	cmd := exec.Command("sh", "-c", get)
	cmd.Dir = work
	if out, err := cmd.CombinedOutput(); err != nil {
		fail("downloading Debian's prometheus package for promtool: %v\n%s", err, out)
	}
	debs, _ := filepath.Glob(filepath.Join(work, "prometheus_*.deb"))
	if len(debs) != 1 {
		fail("apt-get download prometheus left %v", debs)
	}
	tmp := dir + ".tmp"
	_ = os.RemoveAll(tmp)
	if out, err := exec.Command("dpkg-deb", "-x", debs[0], tmp).CombinedOutput(); err != nil {
		fail("dpkg-deb -x: %v\n%s", err, out)
	}
	_ = os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatal(err)
	}
	return bin
}

// TestAlertingRules checks the alerting rules the package ships with
// promtool, and runs their unit tests: every alert fires on series that
// call for it and resolves once they recover.
func TestAlertingRules(t *testing.T) {
	bin := promtool(t)
	dir := filepath.Join(repo, "packaging", "prometheus")
	for _, args := range [][]string{
		{"check", "rules", "kvmount-alerts.yml"},
		{"test", "rules", "kvmount-alerts.test.yml"},
	} {
		cmd := exec.Command(bin, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "SUCCESS") {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}
