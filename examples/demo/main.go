// Command demo shows kvmount end to end with nothing but Go installed: it
// starts an in-process etcd, seeds a few keys, runs the kvmount daemon
// projecting them into a local directory, changes and deletes a key while it
// runs, and prints the directory tree — ..data and all — before and after.
//
//	go run ./examples/demo [-keep]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvmount/kvmount/daemon"
	"github.com/kvmount/kvmount/internal/embedetcd"
	"github.com/kvmount/kvmount/source"
	"github.com/kvmount/kvmount/source/etcd"
)

// waitTimeout bounds each wait for a change to reach the directory.
const waitTimeout = 20 * time.Second

// configTemplate is the demo's configuration; %s are the state directory,
// the etcd endpoint and the mount directory.
const configTemplate = `state_dir = %q
log_format = "text"

[admin]
address = "" # the demo serves no admin endpoint

[sources.main]
type = "etcd"
endpoints = [%q]

[[mount]]
name = "app"
dir = %q
source = "main"
prefix = "/apps/app/"
`

func main() {
	// The daemon's worker is this program started again.
	daemon.MaybeWorker(registry())
	keep := flag.Bool("keep", false, "keep the demo directory at the end")
	flag.Parse()
	if _, err := run(*keep); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// run runs the demo; it returns how long after the write started the
// mount switched to the new version.
func run(keep bool) (switched time.Duration, _ error) {
	base, err := os.MkdirTemp("", "kvmount-demo-")
	if err != nil {
		return 0, err
	}
	if !keep {
		defer os.RemoveAll(base)
	}
	fmt.Println("== starting an in-process etcd")
	srv, err := embedetcd.Start(filepath.Join(base, "etcd"), embedetcd.Options{Fsync: true})
	if err != nil {
		return 0, err
	}
	defer srv.Stop()
	cli, err := srv.Client()
	if err != nil {
		return 0, err
	}
	defer cli.Close()

	fmt.Println("== seeding keys under /apps/app/")
	if err := put(cli,
		"/apps/app/app.conf", "listen = 8080\nlog_level = info\n",
		"/apps/app/tls/cert.pem", "-----BEGIN CERTIFICATE-----\n(demo)\n-----END CERTIFICATE-----\n",
		"/apps/app/feature-flags", "dark_mode=off\n",
	); err != nil {
		return 0, err
	}

	dir := filepath.Join(base, "run", "app", "config")
	configPath := filepath.Join(base, "kvmount.toml")
	config := fmt.Sprintf(configTemplate, filepath.Join(base, "state"), srv.Endpoint(), dir)
	if err := os.WriteFile(configPath, []byte(config), 0o644); err != nil {
		return 0, err
	}
	fmt.Printf("== running kvmount with %s:\n%s\n", configPath, indent(config))

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- daemon.Run(ctx, daemon.Options{
			ConfigPath: configPath,
			Registry:   registry(),
			LogOutput:  prefixWriter{os.Stdout, "   kvmount | "},
		})
	}()
	stop := func() error {
		cancel()
		return <-done
	}

	if err := waitFor(filepath.Join(dir, "app.conf"), "listen = 8080\nlog_level = info\n"); err != nil {
		stop()
		return 0, err
	}
	fmt.Printf("\n== the mount, as projected (%s):\n", dir)
	printTree(dir)

	fmt.Println("\n== changing app.conf and deleting feature-flags in one transaction")
	before, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		stop()
		return 0, err
	}
	start := time.Now()
	_, err = cli.Txn(context.Background()).Then(
		clientv3.OpPut("/apps/app/app.conf", "listen = 8080\nlog_level = debug\n"),
		clientv3.OpDelete("/apps/app/feature-flags"),
	).Commit()
	if err != nil {
		stop()
		return 0, err
	}
	after, err := waitSwitch(dir, before)
	if err != nil {
		stop()
		return 0, err
	}
	switched = time.Since(start)
	fmt.Printf("   readers see the new version %v after the write started: ..data now points to %s\n", switched.Round(time.Microsecond), after)
	if err := waitFor(filepath.Join(dir, "app.conf"), "listen = 8080\nlog_level = debug\n"); err != nil {
		stop()
		return 0, err
	}
	if err := waitGone(filepath.Join(dir, "feature-flags")); err != nil {
		stop()
		return 0, err
	}
	fmt.Printf("\n== the mount after the change (one new version, switched by one rename of ..data; the replaced %s\n   stays for keep_replaced, 5 s, for readers that resolved ..data just before the switch):\n", before)
	printTree(dir)
	if err := waitOneVersion(dir); err != nil {
		stop()
		return 0, err
	}
	fmt.Printf("   the replaced version %s removed %v after the switch (keep_replaced)\n", before, (time.Since(start) - switched).Round(time.Millisecond))

	if err := stop(); err != nil {
		return 0, err
	}
	if keep {
		fmt.Printf("\n== kept %s\n", base)
	}
	fmt.Println("\n== done")
	return switched, nil
}

func put(cli *clientv3.Client, kv ...string) error {
	ops := make([]clientv3.Op, 0, len(kv)/2)
	for i := 0; i < len(kv); i += 2 {
		ops = append(ops, clientv3.OpPut(kv[i], kv[i+1]))
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	_, err := cli.Txn(ctx).Then(ops...).Commit()
	return err
}

// waitFor waits until path holds want.
func waitFor(path, want string) error {
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		if got, err := os.ReadFile(path); err == nil && string(got) == want {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("%s did not get its content within %v", path, waitTimeout)
}

// waitGone waits until path no longer exists.
func waitGone(path string) error {
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("%s still exists after %v", path, waitTimeout)
}

// waitSwitch waits until dir's ..data no longer points to before, and
// returns what it points to then.
func waitSwitch(dir, before string) (string, error) {
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		if now, err := os.Readlink(filepath.Join(dir, "..data")); err == nil && now != before {
			return now, nil
		}
		time.Sleep(100 * time.Microsecond)
	}
	return "", fmt.Errorf("%s/..data still points to %s after %v", dir, before, waitTimeout)
}

// waitOneVersion waits until the previous version directory is removed,
// the last step of a write.
func waitOneVersion(dir string) error {
	deadline := time.Now().Add(waitTimeout)
	for time.Now().Before(deadline) {
		versions, _ := filepath.Glob(filepath.Join(dir, "..20*"))
		if len(versions) == 1 {
			return nil
		}
		time.Sleep(time.Millisecond)
	}
	return fmt.Errorf("%s still holds an old version after %v", dir, waitTimeout)
}

// printTree prints dir like tree(1): symlinks with their targets, and the
// content of every file reached through the visible names.
func printTree(dir string) {
	fmt.Println("   " + dir)
	walk(dir, "   ")
	fmt.Println()
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "..") {
			continue
		}
		root := filepath.Join(dir, e.Name())
		if info, err := os.Stat(root); err == nil && info.IsDir() {
			root += "/" // the trailing slash makes WalkDir follow the visible symlink
		}
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return nil
			}
			data, _ := os.ReadFile(p)
			rel, _ := filepath.Rel(dir, p)
			fmt.Printf("   %s:\n%s", rel, indent(string(data)))
			return nil
		})
	}
}

func walk(dir, prefix string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	slices.SortFunc(entries, func(a, b os.DirEntry) int { return strings.Compare(a.Name(), b.Name()) })
	for i, e := range entries {
		branch, next := "├── ", "│   "
		if i == len(entries)-1 {
			branch, next = "└── ", "    "
		}
		path := filepath.Join(dir, e.Name())
		if target, err := os.Readlink(path); err == nil {
			fmt.Printf("%s%s%s -> %s\n", prefix, branch, e.Name(), target)
			continue
		}
		if e.IsDir() {
			fmt.Printf("%s%s%s/\n", prefix, branch, e.Name())
			walk(path, prefix+next)
			continue
		}
		fmt.Printf("%s%s%s\n", prefix, branch, e.Name())
	}
}

func indent(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return "      " + strings.Join(lines, "\n      ") + "\n"
}

// prefixWriter prefixes each line written to it, to set kvmount's logs
// apart from the demo's own output.
type prefixWriter struct {
	w      io.Writer
	prefix string
}

func (p prefixWriter) Write(b []byte) (int, error) {
	for line := range strings.SplitSeq(strings.TrimRight(string(b), "\n"), "\n") {
		if _, err := fmt.Fprintln(p.w, p.prefix+line); err != nil {
			return 0, err
		}
	}
	return len(b), nil
}

// registry is the demo's source kinds.
func registry() *source.Registry { return source.NewRegistry(etcd.Kind()) }
