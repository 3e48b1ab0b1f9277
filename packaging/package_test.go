package packaging

import (
	"debug/elf"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/kvmount/kvmount/internal/roottest"
)

// repo is the repository's root, where `make package` writes dist/.
var repo, _ = filepath.Abs("..")

var (
	buildOnce sync.Once
	buildErr  error
)

// buildPackages runs `make package` once per test binary and returns the
// paths of the four packages.
func buildPackages(t *testing.T) map[string]string {
	t.Helper()
	buildOnce.Do(func() {
		cmd := exec.Command("make", "-s", "package")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("make package: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	pkgs := map[string]string{}
	for key, pattern := range map[string]string{
		"deb/amd64": "kvmount_*_amd64.deb", "deb/arm64": "kvmount_*_arm64.deb",
		"rpm/amd64": "kvmount-*.x86_64.rpm", "rpm/arm64": "kvmount-*.aarch64.rpm",
	} {
		m, _ := filepath.Glob(filepath.Join(repo, "dist", pattern))
		if len(m) != 1 {
			t.Fatalf("dist/%s: %d files; want 1", pattern, len(m))
		}
		pkgs[key] = m[0]
	}
	return pkgs
}

// run runs a command and returns its output, failing the test on error.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// requireTools installs the Debian packages that provide the commands
// missing here (roottest.Tools).
func requireTools(t *testing.T, pkgs map[string]string) {
	t.Helper()
	roottest.Tools(t, pkgs)
}

// TestPackageContents inspects the four packages: files, modes, the
// conffile, the maintainer scripts, and binaries for the right machine.
func TestPackageContents(t *testing.T) {
	requireTools(t, map[string]string{"dpkg-deb": "dpkg", "rpm": "rpm"})
	pkgs := buildPackages(t)
	wantFiles := map[string]string{ // path → mode as ls shows it
		"./usr/bin/kvmount":                                      "-rwxr-xr-x",
		"./usr/lib/systemd/system/kvmount.service":               "-rw-r--r--",
		"./usr/lib/sysusers.d/kvmount.conf":                      "-rw-r--r--",
		"./etc/kvmount/kvmount.toml":                             "-rw-r-----",
		"./usr/share/man/man8/kvmount.8.gz":                      "-rw-r--r--",
		"./usr/share/doc/kvmount/copyright":                      "-rw-r--r--",
		"./usr/share/kvmount/prometheus/kvmount-alerts.yml":      "-rw-r--r--",
		"./usr/share/kvmount/prometheus/kvmount-alerts.test.yml": "-rw-r--r--",
		"./usr/share/doc/kvmount/notify-reload.conf":             "-rw-r--r--",
		"./usr/share/doc/kvmount/examples/etcd.toml":             "-rw-r--r--",
		"./usr/share/doc/kvmount/examples/service.toml":          "-rw-r--r--",
		"./usr/share/doc/kvmount/examples/vault-tls.toml":        "-rw-r--r--",
	}
	for _, arch := range []string{"amd64", "arm64"} {
		deb := pkgs["deb/"+arch]
		list := run(t, "dpkg-deb", "-c", deb)
		for path, mode := range wantFiles {
			if !strings.Contains(list, mode) || !containsLine(list, mode, path) {
				t.Errorf("%s: %s not listed with mode %s:\n%s", filepath.Base(deb), path, mode, list)
			}
		}
		control := t.TempDir()
		run(t, "dpkg-deb", "-e", deb, control)
		if conffiles, _ := os.ReadFile(filepath.Join(control, "conffiles")); strings.TrimSpace(string(conffiles)) != "/etc/kvmount/kvmount.toml" {
			t.Errorf("%s: conffiles %q", filepath.Base(deb), conffiles)
		}
		for _, script := range []string{"postinst", "prerm", "postrm"} {
			info, err := os.Stat(filepath.Join(control, script))
			if err != nil || info.Mode()&0o111 == 0 {
				t.Errorf("%s: maintainer script %s: %v", filepath.Base(deb), script, err)
			}
		}
		if info := run(t, "dpkg-deb", "-f", deb, "Architecture"); strings.TrimSpace(info) != arch {
			t.Errorf("%s: Architecture %q", filepath.Base(deb), info)
		}
		// The binary is built for the package's machine.
		extract := t.TempDir()
		run(t, "dpkg-deb", "-x", deb, extract)
		// Debian's machine-readable copyright file names the license.
		if copyright, _ := os.ReadFile(filepath.Join(extract, "usr/share/doc/kvmount/copyright")); !strings.Contains(string(copyright), "\nLicense: Apache-2.0\n") {
			t.Errorf("%s: the copyright file does not name Apache-2.0:\n%s", filepath.Base(deb), copyright)
		}
		f, err := elf.Open(filepath.Join(extract, "usr/bin/kvmount"))
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[arch]
		if f.Machine != want {
			t.Errorf("%s: binary for %v; want %v", filepath.Base(deb), f.Machine, want)
		}
		f.Close()
		if arch == runtime.GOARCH {
			out := run(t, filepath.Join(extract, "usr/bin/kvmount"), "version")
			if !strings.HasPrefix(out, "kvmount 0") && !strings.HasPrefix(out, "kvmount 1") || !strings.Contains(out, "go1.") {
				t.Errorf("kvmount version = %q; want version, commit and Go version", out)
			}
			if out := run(t, filepath.Join(extract, "usr/bin/kvmount"), "check", "-config", filepath.Join(extract, "etc/kvmount/kvmount.toml")); !strings.Contains(out, "OK (0 sources, 0 mounts") {
				t.Errorf("the shipped configuration: %s", out)
			}
		}

		rpm := pkgs["rpm/"+arch]
		rlist := run(t, "rpm", "-qlpv", rpm)
		for path, mode := range wantFiles {
			if !containsLine(rlist, mode, strings.TrimPrefix(path, ".")) {
				t.Errorf("%s: %s not listed with mode %s:\n%s", filepath.Base(rpm), path, mode, rlist)
			}
		}
		if cfg := run(t, "rpm", "-qp", "--configfiles", rpm); strings.TrimSpace(cfg) != "/etc/kvmount/kvmount.toml" {
			t.Errorf("%s: config files %q", filepath.Base(rpm), cfg)
		}
		if flags := run(t, "rpm", "-qp", "--qf", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]", rpm); !strings.Contains(flags, "cn /etc/kvmount/kvmount.toml") {
			t.Errorf("%s: the configuration is not config(noreplace):\n%s", filepath.Base(rpm), flags)
		}
		if license := run(t, "rpm", "-qp", "--qf", "%{LICENSE}", rpm); license != "Apache-2.0" {
			t.Errorf("%s: License %q; want Apache-2.0", filepath.Base(rpm), license)
		}
		scripts := run(t, "rpm", "-qp", "--scripts", rpm)
		for _, want := range []string{"postinstall scriptlet", "systemctl preset kvmount.service", "preuninstall scriptlet", "disable --now kvmount.service", "postuninstall scriptlet", "try-restart kvmount.service"} {
			if !strings.Contains(scripts, want) {
				t.Errorf("%s: scripts lack %q:\n%s", filepath.Base(rpm), want, scripts)
			}
		}
	}
}

// containsLine reports whether some line of list holds both mode and path
// (as its last field).
func containsLine(list, mode, path string) bool {
	for line := range strings.SplitSeq(list, "\n") {
		fields := strings.Fields(line)
		if len(fields) > 0 && strings.HasPrefix(line, mode) && fields[len(fields)-1] == path {
			return true
		}
	}
	return false
}
