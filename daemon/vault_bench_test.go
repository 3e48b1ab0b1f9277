package daemon

import (
	"context"
	"crypto/tls"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/testlog"
	"github.com/kvmount/kvmount/internal/vaulttest"
)

// The Vault benchmarks run kvmount (its own process, as in production) and
// consul-template v0.42.1 (built from its module by
// scripts/consul-template.sh) side by side against one Vault dev server,
// each writing to a tmpfs: BenchmarkVaultPutToFile measures a KV v2 put to
// the file, BenchmarkVaultPKIRotation what a reader sees while a
// certificate is issued again and again. Run them with a small
// -benchtime: every iteration waits for a poll or a certificate.

// vaultBench is what the Vault benchmarks share: a dev server, a token
// file, and a tmpfs for the tools' output.
type vaultBench struct {
	srv   *vaulttest.Server
	token string
	base  string // on tmpfs
}

func newVaultBench(b *testing.B) *vaultBench {
	b.Helper()
	srv := vaulttest.Start(b)
	base := b.TempDir()
	if err := unix.Mount("tmpfs", base, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=64m,mode=0755"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = unix.Unmount(base, unix.MNT_DETACH) })
	token := filepath.Join(b.TempDir(), "token")
	if err := os.WriteFile(token, []byte(vaulttest.RootToken), 0o600); err != nil {
		b.Fatal(err)
	}
	return &vaultBench{srv: srv, token: token, base: base}
}

// kvmount runs the kvmount binary with the vault source, polling every
// poll, and the mount table mount (dir and source are set), projecting
// into a directory of the tmpfs, which it returns.
func (v *vaultBench) kvmount(b *testing.B, name, poll, mount string) string {
	b.Helper()
	dir := filepath.Join(v.base, name)
	cfg := fmt.Sprintf("state_dir = %q\nresync_interval = \"1h\"\n%s[sources.vault]\ntype = \"vault\"\naddress = %q\ntoken_file = %q\npoll_interval = %q\n\n[[mount]]\nname = \"bench\"\ndir = %q\nmedium = \"tmpfs\"\nsource = \"vault\"\n%s",
		filepath.Join(b.TempDir(), "state"), noAdmin(b, buildKvmount(b)), v.srv.URL(), v.token, poll, dir, mount)
	path := filepath.Join(b.TempDir(), "kvmount.toml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}
	v.process(b, exec.Command(buildKvmount(b), "run", "-config", path), syscall.SIGTERM)
	b.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	return dir
}

// consulTemplate runs consul-template against the server with templates
// (name → text) rendered into a directory of the tmpfs, which it returns;
// a secret without a lease is read again every defaultLease × about 0.9
// (its vault.default_lease_duration).
func (v *vaultBench) consulTemplate(b *testing.B, name, defaultLease string, templates map[string]string) string {
	b.Helper()
	ct := consulTemplateBinary(b)
	dir := filepath.Join(v.base, name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	args := []string{"-vault-addr", v.srv.URL(), "-vault-token", vaulttest.RootToken, "-vault-renew-token=false",
		"-vault-default-lease-duration", defaultLease, "-log-level", "err"}
	for file, text := range templates {
		in := filepath.Join(b.TempDir(), file+".tmpl")
		if err := os.WriteFile(in, []byte(text), 0o644); err != nil {
			b.Fatal(err)
		}
		args = append(args, "-template", in+":"+filepath.Join(dir, file))
	}
	cmd := exec.Command(ct, args...)
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + b.TempDir()}
	// consul-template stops on its kill_signal, SIGINT by default; it
	// ignores SIGTERM without an exec child to pass it to.
	v.process(b, cmd, syscall.SIGINT)
	return dir
}

// process starts cmd, stopped with stop when the benchmark ends.
func (v *vaultBench) process(b *testing.B, cmd *exec.Cmd, stop syscall.Signal) {
	b.Helper()
	logs := &testlog.Buffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = cmd.Process.Signal(stop)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(waitTimeout):
			b.Errorf("%s did not stop on %v", filepath.Base(cmd.Path), stop)
			_ = cmd.Process.Kill()
			<-done
		}
		if b.Failed() {
			b.Logf("%s:\n%s", filepath.Base(cmd.Path), logs)
		}
	})
}

// waitFileContent waits until the file at p holds want.
func waitFileContent(b *testing.B, p, want string) {
	b.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		if got, err := os.ReadFile(p); err == nil && string(got) == want {
			return
		}
		if time.Now().After(deadline) {
			got, err := os.ReadFile(p)
			b.Fatalf("%s = %q, %v; want %q", p, got, err, want)
		}
		time.Sleep(time.Millisecond)
	}
}

// dirWatcher reports renames into, and writes closed in, a directory,
// through inotify: a file consul-template or kvmount replaced.
type dirWatcher struct{ fd int }

func watchDir(b *testing.B, dir string) *dirWatcher {
	b.Helper()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_MOVED_TO|unix.IN_CLOSE_WRITE); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { unix.Close(fd) })
	return &dirWatcher{fd: fd}
}

// until waits for events until ok holds, for at most waitTimeout.
func (w *dirWatcher) until(b *testing.B, ok func() bool) {
	b.Helper()
	buf := make([]byte, 4096)
	deadline := time.Now().Add(waitTimeout)
	for !ok() {
		fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}}
		if n, err := unix.Poll(fds, 100); err == nil && n > 0 {
			_, _ = unix.Read(w.fd, buf)
		}
		if time.Now().After(deadline) {
			b.Fatal("no change within the timeout")
		}
	}
}

// BenchmarkVaultPutToFile is the latency from a KV v2 put (a new version of
// one secret) to its field's new value in a file, for kvmount polling every
// interval and for consul-template reading the secret again every
// vault.default_lease_duration of the same interval (about 0.9 of it: a KV
// secret has no lease). Vault has no blocking queries, and its event
// subscriptions are an Enterprise feature (404 on this community server):
// both tools poll, so the latency follows the interval. Each put comes at a
// random point of it.
func BenchmarkVaultPutToFile(b *testing.B) {
	for _, interval := range []string{"250ms", "1s"} {
		phase, _ := time.ParseDuration(interval)
		b.Run("kvmount/poll="+interval, func(b *testing.B) {
			v := newVaultBench(b)
			v.srv.Put(b, "secret", "bench/s", map[string]any{"v": "initial"})
			dir := v.kvmount(b, "kvmount", interval, "prefix = \"secret/bench/s\"\n")
			waitFileContent(b, filepath.Join(dir, "v"), "initial")
			measurePuts(b, v, watchDir(b, dir), filepath.Join(dir, "v"), phase)
		})
		b.Run("consul-template/default_lease="+interval, func(b *testing.B) {
			v := newVaultBench(b)
			v.srv.Put(b, "secret", "bench/s", map[string]any{"v": "initial"})
			dir := v.consulTemplate(b, "ct", interval, map[string]string{"v": `{{ with secret "secret/data/bench/s" }}{{ .Data.data.v }}{{ end }}`})
			waitFileContent(b, filepath.Join(dir, "v"), "initial")
			measurePuts(b, v, watchDir(b, dir), filepath.Join(dir, "v"), phase)
		})
	}
}

// measurePuts puts b.N new versions of secret/bench/s, one at a time, each
// once the file at p shows the last and a random time of at most phase
// after it (a put right after a poll would always wait a whole interval),
// and reports the latency's percentiles.
func measurePuts(b *testing.B, v *vaultBench, w *dirWatcher, p string, phase time.Duration) {
	kv := v.srv.Client(b).KVv2("secret")
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		b.StopTimer()
		time.Sleep(rand.N(phase))
		b.StartTimer()
		value := fmt.Sprintf("update %d", i)
		start := time.Now()
		if _, err := kv.Put(context.Background(), "bench/s", map[string]any{"v": value}); err != nil {
			b.Fatal(err)
		}
		w.until(b, func() bool {
			got, err := os.ReadFile(p)
			return err == nil && string(got) == value
		})
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	report(b, "put-to-file", lat)
}

// BenchmarkVaultPKIRotation issues a certificate valid for 3 s, b.N times
// over, with kvmount (a [mount.pki] projection) and with consul-template
// (the same issue read by secret in two templates, certificate and key, as
// vault-agent users write them), while readers loop on the files: a naive
// one reads the certificate's path, then the key's; with kvmount, a
// careful one also resolves ..data once and reads both in that version.
// It reports the reads whose certificate and key do not match
// (tls.X509KeyPair), and the rounds each reader made. A naive reader of
// kvmount's mount can still mix two versions — a switch between its two
// opens —, but never a half-written one; the careful reader cannot.
func BenchmarkVaultPKIRotation(b *testing.B) {
	setup := func(b *testing.B) *vaultBench {
		v := newVaultBench(b)
		enableVaultPKI(b, v.srv, false)
		return v
	}
	b.Run("kvmount", func(b *testing.B) {
		v := setup(b)
		dir := v.kvmount(b, "kvmount", "1m", "  [mount.pki]\n  role = \"pki/issue/web\"\n  common_name = \"web.example.com\"\n  ttl = \"3s\"\n")
		waitNonEmpty(b, filepath.Join(dir, "private_key"))
		naive := startPairReader(b, filepath.Join(dir, "certificate"), filepath.Join(dir, "private_key"), "")
		careful := startPairReader(b, "certificate", "private_key", dir)
		rotations(b, dir, "certificate")
		naive.report(b, "naive")
		careful.report(b, "careful")
	})
	b.Run("consul-template", func(b *testing.B) {
		v := setup(b)
		issue := `{{ with secret "pki/issue/web" "common_name=web.example.com" "ttl=3s" }}`
		dir := v.consulTemplate(b, "ct", "5m", map[string]string{
			"cert.pem": issue + `{{ .Data.certificate }}{{ end }}`,
			"key.pem":  issue + `{{ .Data.private_key }}{{ end }}`,
		})
		waitNonEmpty(b, filepath.Join(dir, "key.pem"))
		naive := startPairReader(b, filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem"), "")
		rotations(b, dir, "cert.pem")
		naive.report(b, "naive")
	})
}

// waitNonEmpty waits until the file at p exists and is not empty.
func waitNonEmpty(b *testing.B, p string) {
	b.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		if st, err := os.Stat(p); err == nil && st.Size() > 0 {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s never appeared", p)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// rotations waits for b.N new certificates in the file name of dir,
// timing the benchmark over them, and reports the mean time between two.
func rotations(b *testing.B, dir, name string) {
	w := watchDir(b, dir)
	read := func() string { data, _ := os.ReadFile(filepath.Join(dir, name)); return string(data) }
	b.ResetTimer()
	start := time.Now()
	last := read()
	for range b.N {
		w.until(b, func() bool { cur := read(); return cur != "" && cur != last })
		last = read()
	}
	b.StopTimer()
	b.ReportMetric(time.Since(start).Seconds()/float64(b.N), "s/rotation")
}

// pairReader reads a certificate and its key in a loop and counts the
// pairs that do not match.
type pairReader struct {
	stop       chan struct{}
	wg         sync.WaitGroup
	rounds     atomic.Int64
	mismatched atomic.Int64
	// unusable counts pairs that failed otherwise (a file cut short).
	unusable atomic.Int64
}

// startPairReader reads cert and key in a loop until the benchmark ends:
// as they are (naive), or, with dir, resolving dir's ..data once a round
// and reading both in that version (careful).
func startPairReader(b *testing.B, cert, key, dir string) *pairReader {
	r := &pairReader{stop: make(chan struct{})}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for {
			select {
			case <-r.stop:
				return
			default:
			}
			c, k := cert, key
			if dir != "" {
				version, err := os.Readlink(filepath.Join(dir, "..data"))
				if err != nil {
					continue
				}
				c, k = filepath.Join(dir, version, cert), filepath.Join(dir, version, key)
			}
			cb, err1 := os.ReadFile(c)
			kb, err2 := os.ReadFile(k)
			if err1 != nil || err2 != nil || len(cb) == 0 || len(kb) == 0 {
				continue // a version removed meanwhile, or a file being written
			}
			r.rounds.Add(1)
			if _, err := tls.X509KeyPair(cb, kb); err != nil {
				if strings.Contains(err.Error(), "does not match") {
					r.mismatched.Add(1)
				} else {
					r.unusable.Add(1)
				}
			}
		}
	}()
	b.Cleanup(func() { r.halt() })
	return r
}

// halt stops the reader and waits for it.
func (r *pairReader) halt() {
	select {
	case <-r.stop:
	default:
		close(r.stop)
	}
	r.wg.Wait()
}

// report stops the reader and reports its rounds and mismatches as name's.
func (r *pairReader) report(b *testing.B, name string) {
	r.halt()
	b.ReportMetric(float64(r.rounds.Load()), name+"-reads")
	b.ReportMetric(float64(r.mismatched.Load()), name+"-mismatched")
	b.ReportMetric(float64(r.unusable.Load()), name+"-unusable")
}
