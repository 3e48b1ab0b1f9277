package packaging

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/etcdtest"
	"github.com/kvmount/kvmount/internal/roottest"
	"github.com/kvmount/kvmount/internal/vaulttest"
)

// waitTimeout bounds every wait on the container.
const waitTimeout = 60 * time.Second

// rootfs returns a minimal Debian 12 root file system with systemd and
// D-Bus, procps (which the .deb depends on), rpm (to install the .rpm: no
// Red Hat system's packages are reachable here) and nginx-light (the
// service of the nginx recipe), made once with debootstrap (from Debian's
// packages) and cached outside the repository under ~/.cache/kvmount/.
// nginx's default site is removed: the container shares the host's
// network, and nothing may listen on its port 80.
func rootfs(t *testing.T) string {
	t.Helper()
	cache := os.Getenv("XDG_CACHE_HOME")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache")
	}
	dir := filepath.Join(cache, "kvmount", "rootfs-bookworm-v4")
	if _, err := os.Stat(filepath.Join(dir, "usr/lib/systemd/systemd")); err == nil {
		return dir
	}
	tmp := dir + ".tmp"
	_ = os.RemoveAll(tmp)
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Logf("building %s with debootstrap (once; about a minute or two)", dir)
	out, err := exec.Command("debootstrap", "--variant=minbase", "--include=systemd,systemd-sysv,dbus,procps,rpm,nginx-light", "bookworm", tmp, "http://deb.debian.org/debian").CombinedOutput()
	if err != nil {
		t.Fatalf("debootstrap: %v\n%s", err, lastLines(string(out), 20))
	}
	if err := os.Remove(filepath.Join(tmp, "etc/nginx/sites-enabled/default")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		t.Fatal(err)
	}
	return dir
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// container is a booted systemd in an ephemeral copy of the root file
// system; commands run in it through nsenter.
type container struct {
	t    *testing.T
	cmd  *exec.Cmd
	init int // the container's PID 1, as the host sees it
}

// boot starts systemd in an ephemeral container sharing the host's
// network, with dist/ bound read-only at /dist, and waits until it runs.
func boot(t *testing.T, dist string) *container {
	t.Helper()
	cmd := exec.Command("systemd-nspawn", "--ephemeral", "--register=no", "--keep-unit", "--quiet", "-b",
		"-D", rootfs(t), "--bind-ro="+dist+":/dist")
	var console strings.Builder
	cmd.Stdout, cmd.Stderr = &console, &console
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &container{t: t, cmd: cmd}
	t.Cleanup(func() {
		// SIGTERM makes nspawn power the container off; the ephemeral
		// copy goes with it.
		_ = cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("container console:\n%s", lastLines(console.String(), 40))
		}
	})
	deadline := time.Now().Add(waitTimeout)
	// nspawn's child named systemd is the container's init; another child
	// may come and go first (the ephemeral copy).
	for c.init == 0 {
		if data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid)); err == nil {
			for _, f := range strings.Fields(string(data)) {
				if comm, _ := os.ReadFile("/proc/" + f + "/comm"); strings.TrimSpace(string(comm)) == "systemd" {
					c.init, _ = strconv.Atoi(f)
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the container's init never started:\n%s", console.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for {
		out, _ := c.try("systemctl", "is-system-running")
		if s := strings.TrimSpace(out); s == "running" || s == "degraded" {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("systemd never finished booting (%q):\n%s", out, console.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// try runs argv in the container and returns its output and error.
func (c *container) try(argv ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, "nsenter", append([]string{"-t", strconv.Itoa(c.init), "-a", "--"}, argv...)...).CombinedOutput()
	return string(out), err
}

// sh runs a shell command in the container, failing the test on error.
func (c *container) sh(script string) string {
	c.t.Helper()
	out, err := c.try("sh", "-c", script)
	if err != nil {
		c.t.Fatalf("in the container: %s: %v\n%s", script, err, out)
	}
	return strings.TrimSpace(out)
}

// waitFor waits until script prints want.
func (c *container) waitFor(script, want string) {
	c.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		out, _ := c.try("sh", "-c", script)
		if strings.TrimSpace(out) == want {
			return
		}
		if time.Now().After(deadline) {
			logs, _ := c.try("sh", "-c", "journalctl -u kvmount --no-pager | grep -v level=DEBUG | tail -n 25")
			c.t.Fatalf("%s prints %q; want %q\nkvmount's journal:\n%s", script, out, want, logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestOnBootedSystemd installs the .deb on a real systemd and runs it as an
// operator would: enabled and started, Type=notify with a status, a reload
// that adds a disk and a tmpfs mount (the tmpfs visible outside the
// service), an update, a systemd_unit notification over D-Bus, a SIGKILL
// that systemd answers with a restart that adopts the mounts without
// rewriting them, a reinstall (an upgrade to the maintainer scripts) that
// keeps an edited conffile and restarts the service, which adopts its
// mounts, an upgrade that leaves the service alone while its configuration
// fails check, a stop that keeps the content, and a purge.
func TestOnBootedSystemd(t *testing.T) {
	roottest.Require(t)
	requireTools(t, map[string]string{"debootstrap": "debootstrap", "systemd-nspawn": "systemd-container", "nsenter": "util-linux"})
	pkgs := buildPackages(t)
	srv, cli := etcdtest.Start(t) // on 127.0.0.1: the container shares the host's network
	etcdtest.Put(t, cli, "/web/site.conf", "listen 80;", "/secrets/db", "hunter2")
	c := boot(t, filepath.Join(repo, "dist"))
	deb := "/dist/" + filepath.Base(pkgs["deb/"+runtimeArch()])

	start := time.Now()
	c.sh("dpkg -i " + deb)
	c.waitFor("systemctl is-active kvmount", "active")
	if got := c.sh("systemctl is-enabled kvmount"); got != "enabled" {
		t.Errorf("after install: %s; want enabled", got)
	}
	if got := c.sh("systemctl show -p Type --value kvmount"); got != "notify" {
		t.Errorf("Type=%s; want notify", got)
	}
	c.waitFor("systemctl show -p StatusText --value kvmount", "0 mounts")
	if out, err := c.try("systemd-analyze", "verify", "--man=no", "/usr/lib/systemd/system/kvmount.service"); err != nil {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	security := c.sh("systemd-analyze security kvmount --no-pager | tail -1")
	t.Logf("systemd-analyze security: %s", security)
	t.Logf("what still counts against it:\n%s", c.sh("systemd-analyze security kvmount --no-pager | grep '✗' | head -40"))
	// Exactly the capabilities the unit names: CAP_CHOWN (0),
	// CAP_DAC_OVERRIDE (1), CAP_FOWNER (3), CAP_KILL (5), CAP_SETGID (6),
	// CAP_SETUID (7), CAP_SETPCAP (8), CAP_SYS_ADMIN (21).
	if got := c.sh("grep CapBnd /proc/$(systemctl show -p MainPID --value kvmount)/status"); !strings.HasSuffix(got, "00000000002001eb") {
		t.Errorf("kvmount's bounding set: %s; want 00000000002001eb", got)
	}

	// A unit that counts its reloads, for the systemd_unit notifier.
	c.sh("cat > /etc/systemd/system/counter.service <<'UNIT_END'\n[Service]\nExecStart=/bin/sleep infinity\nExecReload=/bin/sh -c 'echo reload >> /var/tmp/reloads'\nUNIT_END\nsystemctl daemon-reload && systemctl start counter")
	config := fmt.Sprintf(`
[sources.main]
type = "etcd"
endpoints = [%q]

[[mount]]
name = "web"
dir = "/srv/web"
source = "main"
prefix = "/web/"
  [[mount.notify]]
  systemd_unit = "counter.service"
  action = "reload"

[[mount]]
name = "secrets"
dir = "/run/secrets"
medium = "tmpfs"
default_mode = "0400"
source = "main"
prefix = "/secrets/"
`, srv.Endpoint())
	c.sh("cat >> /etc/kvmount/kvmount.toml <<'KVMOUNT_END'" + config + "KVMOUNT_END")
	c.sh("kvmount check -config /etc/kvmount/kvmount.toml && systemctl reload kvmount")
	c.waitFor("cat /srv/web/site.conf", "listen 80;")
	c.waitFor("cat /run/secrets/db", "hunter2")
	checkWorker(t, c)
	// This shell is outside the service: the tmpfs is visible here.
	if got := c.sh("findmnt -n -o SOURCE,FSTYPE /run/secrets"); strings.Join(strings.Fields(got), " ") != "kvmount tmpfs" {
		t.Errorf("findmnt /run/secrets = %q; want kvmount's tmpfs", got)
	}
	c.waitFor("systemctl show -p StatusText --value kvmount", "2 mounts: 2 current")
	c.waitFor("wc -l < /var/tmp/reloads", "1") // the first projection

	etcdtest.Put(t, cli, "/web/site.conf", "listen 8080;")
	c.waitFor("cat /srv/web/site.conf", "listen 8080;")
	c.waitFor("wc -l < /var/tmp/reloads", "2")

	// SIGKILL: systemd restarts it; the mounts are adopted, not rewritten.
	web, secrets := c.sh("readlink /srv/web/..data"), c.sh("readlink /run/secrets/..data")
	pid := c.sh("systemctl show -p MainPID --value kvmount")
	c.sh("systemctl kill -s KILL kvmount")
	deadline := time.Now().Add(waitTimeout)
	for {
		now := c.sh("systemctl show -p MainPID --value kvmount")
		if now != pid && now != "0" && c.sh("systemctl is-active kvmount || true") == "active" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvmount not restarted after SIGKILL (MainPID %s)", now)
		}
		time.Sleep(50 * time.Millisecond)
	}
	c.waitFor("systemctl show -p StatusText --value kvmount", "2 mounts: 2 current")
	if w, s := c.sh("readlink /srv/web/..data"), c.sh("readlink /run/secrets/..data"); w != web || s != secrets {
		t.Errorf("after the restart ..data -> %s, %s; want %s, %s (adopted, not rewritten)", w, s, web, secrets)
	}
	if n := c.sh("findmnt -n /run/secrets | wc -l"); n != "1" {
		t.Errorf("%s mounts at /run/secrets after the restart; want 1", n)
	}
	if got := c.sh("wc -l < /var/tmp/reloads"); got != "2" {
		t.Errorf("reloads after the restart: %s; want 2 (an adoption notifies nothing)", got)
	}

	// Reinstalling (an upgrade, to the maintainer scripts) keeps the
	// edited conffile and restarts the service, which adopts its mounts.
	pid = c.sh("systemctl show -p MainPID --value kvmount")
	c.sh("DEBIAN_FRONTEND=noninteractive dpkg -i --force-confold " + deb)
	if got := c.sh("grep -c '^name = ' /etc/kvmount/kvmount.toml"); got != "2" {
		t.Errorf("the edited conffile lost its mounts on reinstall (%s)", got)
	}
	c.waitFor("systemctl is-active kvmount", "active")
	if now := c.sh("systemctl show -p MainPID --value kvmount"); now == pid {
		t.Errorf("the upgrade did not restart kvmount (MainPID still %s)", pid)
	}
	c.waitFor("systemctl show -p StatusText --value kvmount", "2 mounts: 2 current")
	if w, s := c.sh("readlink /srv/web/..data"), c.sh("readlink /run/secrets/..data"); w != web || s != secrets {
		t.Errorf("after the upgrade ..data -> %s, %s; want %s, %s (adopted, not rewritten)", w, s, web, secrets)
	}

	// An upgrade while the configuration fails `kvmount check` leaves the
	// running service alone, and says why.
	c.sh("cp /etc/kvmount/kvmount.toml /var/tmp/good.toml && echo 'bogus = 1' >> /etc/kvmount/kvmount.toml")
	pid = c.sh("systemctl show -p MainPID --value kvmount")
	if out := c.sh("DEBIAN_FRONTEND=noninteractive dpkg -i --force-confold " + deb + " 2>&1"); !strings.Contains(out, "does not pass 'kvmount check'; the running service was not restarted") {
		t.Errorf("an upgrade with a bad configuration printed:\n%s\nwant it to say the service was not restarted", out)
	}
	if now := c.sh("systemctl show -p MainPID --value kvmount"); now != pid || c.sh("systemctl is-active kvmount || true") != "active" {
		t.Errorf("an upgrade with a bad configuration touched the running service (MainPID %s, was %s)", now, pid)
	}
	c.sh("cp /var/tmp/good.toml /etc/kvmount/kvmount.toml")

	// A stop keeps the content.
	c.sh("systemctl stop kvmount")
	if got := c.sh("cat /srv/web/site.conf"); got != "listen 8080;" {
		t.Errorf("after stop: %q", got)
	}
	// A purge removes the unit, the configuration and the state.
	c.sh("dpkg --purge kvmount")
	for _, path := range []string{"/usr/lib/systemd/system/kvmount.service", "/etc/kvmount", "/var/lib/kvmount", "/usr/bin/kvmount"} {
		if out, err := c.try("test", "-e", path); err == nil {
			t.Errorf("%s still exists after purge %s", path, out)
		}
	}
	t.Logf("install to purge on a booted systemd: %v", time.Since(start).Round(time.Millisecond))
}

// TestRPMOnBootedSystemd installs the .rpm on a real systemd and runs its
// scriptlets as rpm runs them. The system is Debian's, with Debian's rpm
// (no Red Hat system is reachable from here), so the scriptlets meet a
// real systemd but not a Red Hat preset policy: %post applies the presets
// (Debian has none, so the service is enabled) and starts nothing; a start
// runs the service; a reinstall runs the scriptlets of an upgrade, which
// restart the service, and it adopts its mounts; an erase stops and
// disables it and leaves the mount's content.
func TestRPMOnBootedSystemd(t *testing.T) {
	roottest.Require(t)
	requireTools(t, map[string]string{"debootstrap": "debootstrap", "systemd-nspawn": "systemd-container", "nsenter": "util-linux"})
	pkgs := buildPackages(t)
	srv, cli := etcdtest.Start(t) // on 127.0.0.1: the container shares the host's network
	etcdtest.Put(t, cli, "/web/site.conf", "listen 80;")
	c := boot(t, filepath.Join(repo, "dist"))
	// Debian's rpm refuses to install without --force-debian; --nodeps as
	// the rpm database knows none of the system's packages.
	rpm := "rpm --force-debian --nodeps "
	pkg := "/dist/" + filepath.Base(pkgs["rpm/"+runtimeArch()])

	c.sh(rpm + "-i " + pkg)
	if got := c.sh("systemctl is-active kvmount || true"); got != "inactive" {
		t.Errorf("after install: %s; want inactive (Red Hat's convention: %%post starts nothing)", got)
	}
	if got := c.sh("systemctl is-enabled kvmount || true"); got != "enabled" {
		t.Errorf("after install: %s; want enabled (the presets applied, and Debian has none)", got)
	}
	c.sh(fmt.Sprintf("cat >> /etc/kvmount/kvmount.toml <<'KVMOUNT_END'\n[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n\n[[mount]]\nname = \"web\"\ndir = \"/srv/web\"\nsource = \"main\"\nprefix = \"/web/\"\nKVMOUNT_END", srv.Endpoint()))
	c.sh("systemctl start kvmount")
	c.waitFor("cat /srv/web/site.conf", "listen 80;")
	c.waitFor("systemctl show -p StatusText --value kvmount", "1 mount: 1 current")

	// A reinstall runs %post with 2 and %postun with 1, as an upgrade does:
	// a running service is restarted and adopts its mount.
	web, pid := c.sh("readlink /srv/web/..data"), c.sh("systemctl show -p MainPID --value kvmount")
	c.sh(rpm + "-U --replacepkgs " + pkg)
	c.waitFor("systemctl is-active kvmount", "active")
	if now := c.sh("systemctl show -p MainPID --value kvmount"); now == pid {
		t.Errorf("the upgrade did not restart kvmount (MainPID still %s)", pid)
	}
	c.waitFor("systemctl show -p StatusText --value kvmount", "1 mount: 1 current")
	if got := c.sh("readlink /srv/web/..data"); got != web {
		t.Errorf("after the upgrade ..data -> %s; want %s (adopted, not rewritten)", got, web)
	}
	if got := c.sh("grep -c '^name = ' /etc/kvmount/kvmount.toml"); got != "1" {
		t.Errorf("the edited configuration lost its mount on the upgrade (%s)", got)
	}

	// An erase runs %preun with 0: stopped and disabled, content kept.
	c.sh(rpm + "-e kvmount")
	if got := c.sh("systemctl is-active kvmount || true"); got != "inactive" {
		t.Errorf("after erase: %s; want inactive", got)
	}
	if out, err := c.try("test", "-e", "/usr/bin/kvmount"); err == nil {
		t.Errorf("/usr/bin/kvmount still exists after erase %s", out)
	}
	if got := c.sh("cat /srv/web/site.conf"); got != "listen 80;" {
		t.Errorf("after erase: %q; want the mount's last content", got)
	}
}

// runtimeArch is the Debian architecture of this machine.
func runtimeArch() string {
	out, err := exec.Command("dpkg", "--print-architecture").Output()
	if err != nil {
		return "amd64"
	}
	return strings.TrimSpace(string(out))
}

// TestNginxRecipeOnBootedSystemd runs README's nginx recipe
// (examples/nginx.toml) on a booted Debian 12 with Debian's nginx, as an
// operator would: the keys reach nginx; a broken configuration is vetoed
// by the plain nginx -t (as root: check_user, which kvmount check warns
// about) with Debian's stock nginx.conf including the mount — nginx keeps
// serving, kvmount status shows nginx's reason at the default log level,
// and systemd's status line names the failed check without its output; a
// fix goes through with one reload; nginx stopped by
// hand makes the reload notification fail, kvmount status exits 1 naming
// it, and once nginx runs again the retry succeeds and status is 0 again.
func TestNginxRecipeOnBootedSystemd(t *testing.T) {
	roottest.Require(t)
	requireTools(t, map[string]string{"debootstrap": "debootstrap", "systemd-nspawn": "systemd-container", "nsenter": "util-linux"})
	pkgs := buildPackages(t)
	srv, cli := etcdtest.Start(t)
	port := freePort(t)
	site := func(header string) string {
		return fmt.Sprintf("server {\n    listen 127.0.0.1:%s;\n    root /srv/www;\n    add_header X-Version %s;\n}\n", port, header)
	}
	etcdtest.Put(t, cli, "/apps/nginx/site.conf", site("1"), "/apps/www/index.html", "hello from etcd")
	c := boot(t, filepath.Join(repo, "dist"))
	c.sh("dpkg -i /dist/" + filepath.Base(pkgs["deb/"+runtimeArch()]))
	c.waitFor("systemctl is-active kvmount", "active")
	c.waitFor("systemctl is-active nginx", "active")

	// The recipe, as README and examples/nginx.toml give it.
	recipe, err := os.ReadFile(filepath.Join(repo, "examples", "nginx.toml"))
	if err != nil {
		t.Fatal(err)
	}
	config := strings.Replace(string(recipe), `endpoints = ["http://127.0.0.1:2379"]`, fmt.Sprintf("endpoints = [%q]", srv.Endpoint()), 1)
	c.sh("echo 'include /etc/nginx/conf.d/kvmount/*.conf;' > /etc/nginx/conf.d/kvmount.conf")
	c.sh("cat > /etc/kvmount/kvmount.toml <<'KVMOUNT_END'\n" + config + "KVMOUNT_END")
	if out := c.sh("kvmount check -config /etc/kvmount/kvmount.toml 2>&1"); !strings.Contains(out, "private mount namespace") || !strings.Contains(out, "check_user: commands of this mount run as root") {
		t.Errorf("kvmount check does not say the check sees the new version at the mount's path, or does not warn that it runs as root:\n%s", out)
	}
	c.sh("systemctl reload kvmount")
	get := func() (string, string) {
		resp, err := http.Get("http://127.0.0.1:" + port + "/index.html")
		if err != nil {
			return "", err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.Header.Get("X-Version"), string(body)
	}
	waitServed := func(version string) {
		t.Helper()
		for deadline := time.Now().Add(waitTimeout); ; time.Sleep(50 * time.Millisecond) {
			v, body := get()
			if v == version && body == "hello from etcd" {
				return
			}
			if time.Now().After(deadline) {
				logs, _ := c.try("sh", "-c", "journalctl -u kvmount -u nginx --no-pager | tail -n 30")
				t.Fatalf("nginx serves version %q, %q; want %q\n%s", v, body, version, logs)
			}
		}
	}
	reloads := func() string { return c.sh("journalctl -u nginx -o cat --no-pager | grep -c '^Reloaded' || true") }
	waitServed("1")
	c.waitFor("kvmount status >/dev/null; echo $?", "0")
	before := reloads()

	// A broken configuration: nginx -t refuses it, nginx keeps serving.
	etcdtest.Put(t, cli, "/apps/nginx/site.conf", strings.Replace(site("2"), ":"+port+";", ":99999;", 1))
	// Pending during the quiescence window (wait.min), then failed.
	c.waitFor("kvmount status | grep -c ' failed '; true", "1")
	if code := c.sh("kvmount status >/dev/null; echo $?"); code != "1" {
		t.Errorf("kvmount status exits %s while nginx refuses the version; want 1", code)
	}
	status := c.sh("kvmount status || true")
	for _, want := range []string{"nginx", "failed", `invalid port in "127.0.0.1:99999"`, "/etc/nginx/conf.d/kvmount/site.conf:2"} {
		if !strings.Contains(status, want) {
			t.Errorf("kvmount status lacks %q:\n%s", want, status)
		}
	}
	// systemctl status shows the line to every user: the check is named,
	// its output is not (kvmount status, root's, has it).
	if got := c.sh("systemctl show -p StatusText --value kvmount"); !strings.Contains(got, "check_command /usr/sbin/nginx: exit status 1") || strings.Contains(got, "99999") {
		t.Errorf("systemd's status line: %s; want the failed check named, without nginx's output", got)
	}
	if got := c.sh("grep -c 99999 /etc/nginx/conf.d/kvmount/site.conf || true"); got != "0" {
		t.Error("the refused version reached the mount")
	}
	waitServed("1")

	// The fix goes through, with one reload.
	etcdtest.Put(t, cli, "/apps/nginx/site.conf", site("3"))
	waitServed("3")
	c.waitFor("kvmount status >/dev/null; echo $?", "0")
	if after := reloads(); after != fmt.Sprint(atoi(t, before)+1) {
		t.Errorf("nginx reloaded %s times for the fix; want once (%s before)", after, before)
	}

	// nginx stopped by hand: the reload fails, status says so until it runs.
	c.sh("systemctl stop nginx")
	etcdtest.Put(t, cli, "/apps/nginx/site.conf", site("4"))
	c.waitFor("kvmount status | grep -c notify_failed; true", "1")
	if code := c.sh("kvmount status >/dev/null; echo $?"); code != "1" {
		t.Errorf("kvmount status exits %s while the reload fails; want 1", code)
	}
	if status := c.sh("kvmount status || true"); !strings.Contains(status, "nginx.service") {
		t.Errorf("kvmount status while nginx is stopped does not name it:\n%s", status)
	}
	c.sh("systemctl start nginx")
	waitServed("4")
	c.waitFor("kvmount status >/dev/null; echo $?", "0")
}

// freePort returns a loopback port no one listens on now; the container
// shares the host's network.
func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

func atoi(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// TestVaultTLSRecipeOnBootedSystemd runs README's Vault recipe
// (examples/vault-tls.toml) on a booted Debian 12 with Debian's nginx and a
// Vault dev server over https, with a certificate valid for 9 s so that it
// is issued again about every 6 s: nginx serves each new certificate, a
// client checking every handshake against the PKI's CA never meets an
// expired or mismatched one, and nginx is reloaded once per certificate —
// never failing, as it would on a certificate beside another's key. The
// KV mount holds the service's secret, readable by its group alone.
func TestVaultTLSRecipeOnBootedSystemd(t *testing.T) {
	roottest.Require(t)
	requireTools(t, map[string]string{"debootstrap": "debootstrap", "systemd-nspawn": "systemd-container", "nsenter": "util-linux"})
	pkgs := buildPackages(t)
	srv := vaulttest.StartTLS(t)
	srv.Write(t, "sys/mounts/pki", map[string]any{"type": "pki", "config": map[string]any{"max_lease_ttl": "87600h"}})
	root := srv.Write(t, "pki/root/generate/internal", map[string]any{"common_name": "example.com", "ttl": "8760h"})
	srv.Write(t, "pki/roles/web", map[string]any{"allowed_domains": "example.com", "allow_subdomains": true, "max_ttl": "72h",
		"not_before_duration": "1s", "key_type": "ec", "key_bits": 256})
	srv.Put(t, "secret", "app/db", map[string]any{"user": "ada", "password": "s3cret"})
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM([]byte(root.Data["certificate"].(string))) {
		t.Fatal("no root certificate")
	}
	vaultCA, err := os.ReadFile(srv.CAFile())
	if err != nil {
		t.Fatal(err)
	}

	c := boot(t, filepath.Join(repo, "dist"))
	c.sh("dpkg -i /dist/" + filepath.Base(pkgs["deb/"+runtimeArch()]))
	c.waitFor("systemctl is-active kvmount", "active")
	c.waitFor("systemctl is-active nginx", "active")
	c.sh("umask 077 && printf %s '" + vaulttest.RootToken + "' > /etc/kvmount/vault-token")
	c.sh("cat > /etc/kvmount/vault-ca.pem <<'KVMOUNT_END'\n" + string(vaultCA) + "KVMOUNT_END")
	recipe, err := os.ReadFile(filepath.Join(repo, "examples", "vault-tls.toml"))
	if err != nil {
		t.Fatal(err)
	}
	config := strings.Replace(string(recipe), `address = "https://vault.example:8200"`, fmt.Sprintf("address = %q", srv.URL()), 1)
	config = strings.Replace(config, `ttl = "24h"`, `ttl = "9s"`, 1)
	c.sh("cat > /etc/kvmount/kvmount.toml <<'KVMOUNT_END'\n" + config + "KVMOUNT_END")
	if out := c.sh("kvmount check -config /etc/kvmount/kvmount.toml 2>&1"); !strings.Contains(out, "OK (1 source, 2 mounts, 0 warnings)") {
		t.Errorf("kvmount check:\n%s", out)
	}
	c.sh("systemctl reload kvmount")
	c.waitFor("test -s /run/nginx/tls/fullchain.pem && test -s /run/nginx/tls/private_key && echo yes", "yes")
	c.waitFor("cat /run/app/secrets/db/password", "s3cret")
	if got := c.sh("stat -c '%a %U %G' /run/app/secrets/..data/db/password /run/nginx/tls/..data/private_key"); got != "440 root www-data\n400 root root" {
		t.Errorf("modes and owners:\n%s", got)
	}
	if got := c.sh("findmnt -n -o FSTYPE /run/nginx/tls"); got != "tmpfs" {
		t.Errorf("/run/nginx/tls is on %s; want tmpfs", got)
	}

	// The first certificate's reload done before the one by hand: systemd
	// merges a reload job into one of the same unit still waiting to run
	// (job_type_allows_late_merge in systemd's src/core/job.c), and two
	// reloads asked for together would be counted as one below.
	c.waitFor("journalctl -u kvmount -o cat --no-pager | grep -q 'msg=notified mount=web-tls' && echo yes", "yes")

	port := freePort(t)
	c.sh(fmt.Sprintf("cat > /etc/nginx/conf.d/tls.conf <<'KVMOUNT_END'\nserver {\n    listen 127.0.0.1:%s ssl;\n    ssl_certificate /run/nginx/tls/fullchain.pem;\n    ssl_certificate_key /run/nginx/tls/private_key;\n    location / { return 200 \"ok\\n\"; }\n}\nKVMOUNT_END", port))
	c.sh("systemctl reload nginx")
	served := map[string]bool{}
	for deadline := time.Now().Add(waitTimeout); len(served) < 4; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("nginx served %d certificates in %v; want 4", len(served), waitTimeout)
		}
		conn, err := tls.Dial("tcp", "127.0.0.1:"+port, &tls.Config{RootCAs: roots, ServerName: "www.example.com"})
		if err != nil {
			if !strings.Contains(err.Error(), "connection refused") {
				t.Errorf("handshake: %v", err) // expired, unknown, or mismatched
			}
			continue
		}
		served[conn.ConnectionState().PeerCertificates[0].SerialNumber.String()] = true
		conn.Close()
	}
	c.sh("systemctl stop kvmount")
	projected := atoi(t, c.sh("journalctl -u kvmount -o cat --no-pager | grep -c 'msg=projected mount=web-tls' || true"))
	notified := atoi(t, c.sh("journalctl -u kvmount -o cat --no-pager | grep -c 'msg=notified mount=web-tls' || true"))
	reloads := atoi(t, c.sh("journalctl -u nginx -o cat --no-pager | grep -c '^Reloaded' || true"))
	// Every certificate switched in had its reload, the renewals being 6 s
	// apart: the last one may have been switched in as the service
	// stopped, its reload cancelled.
	if notified != projected && notified != projected-1 {
		t.Errorf("kvmount switched in %d certificates and notified nginx of %d; want each notified", projected, notified)
	}
	// Once per notification, and once by hand for the site; a reload
	// cancelled as the service stopped may still have run.
	if reloads < notified+1 || reloads > projected+1 {
		t.Errorf("nginx reloaded %d times for %d certificates switched in, %d notified (and the site once); want once each", reloads, projected, notified)
	}
	t.Logf("nginx served %d certificates; kvmount switched in %d, notified %d times; nginx reloaded %d times", len(served), projected, notified, reloads)
	if failed := c.sh("journalctl -u nginx -o cat --no-pager | grep -ci 'fail' || true"); failed != "0" {
		t.Errorf("nginx failed %s times:\n%s", failed, c.sh("journalctl -u nginx -o cat --no-pager | tail -n 20"))
	}
	if failed := c.sh("journalctl -u kvmount -o cat --no-pager | grep -c 'notification failed' || true"); failed != "0" {
		t.Errorf("%s notifications failed", failed)
	}
}

// checkWorker checks the worker of the running service as the kernel
// shows it (privsep): a user of its own from systemd's dynamic range,
// locked beside systemd's own dynamic ids, in the package's kvmount
// group; every capability set empty, no_new_privs, a seccomp filter.
func checkWorker(t *testing.T, c *container) {
	t.Helper()
	gid := c.sh("getent group kvmount | cut -d: -f3")
	status := c.sh("cat /proc/$(pgrep -P $(systemctl show -p MainPID --value kvmount) | head -1)/status")
	fields := map[string]string{}
	for _, line := range strings.Split(status, "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			fields[k] = strings.Join(strings.Fields(v), " ")
		}
	}
	uid := strings.Fields(fields["Uid"] + " ?")[0]
	if n, err := strconv.Atoi(uid); err != nil || n < 61184 || n > 65519 {
		t.Errorf("the worker's uid %q; want one of systemd's dynamic range, 61184–65519", uid)
	}
	if lock := c.sh("stat -c '%U %a' /run/systemd/dynamic-uid/" + uid + " 2>&1 || true"); lock != "root 600" {
		t.Errorf("the lock of the worker's uid %s: %q; want root's file, 0600", uid, lock)
	}
	want := map[string]string{
		"Uid": strings.Repeat(uid+" ", 3) + uid, "Gid": strings.Repeat(gid+" ", 3) + gid, "CapEff": "0000000000000000", "CapPrm": "0000000000000000",
		"CapBnd": "0000000000000000", "CapInh": "0000000000000000", "CapAmb": "0000000000000000",
		"NoNewPrivs": "1", "Seccomp": "2",
	}
	for k, v := range want {
		if fields[k] != v {
			t.Errorf("the worker's %s: %q; want %q\n%s", k, fields[k], v, status)
		}
	}
}
