package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hashicorp/consul/api"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// The floor of put → file (issue 37, 0): what a program that does nothing
// but follow one key and switch a directory to it costs, run as its own
// process beside kvmount's in the same benchmark run. It watches the key
// (an etcd watch, or a Consul blocking query), and on each new value
// writes it into a new version directory, points ..data_tmp at it and
// renames that over ..data — the atomic writer's switch with nothing
// around it: no payload assembled, no second process, no manifest, no
// reconciler. On disk it fsyncs the file, the version directory and the
// mount directory, as kvmount's disk medium does; on tmpfs nothing.
//
// The benchmark binary itself is the floor process, started with floorEnv
// set to "STORE|ENDPOINT|KEY|DIR|MEDIUM" (STORE etcd or consul); TestMain
// runs floorMain then and never returns.
const floorEnv = "KVMOUNT_BENCH_FLOOR"

// startFloor starts the floor process for store's key prefix+key-00000 in
// a mount directory of the medium ("disk" or "tmpfs": a tmpfs is mounted
// there), and returns the directory once it shows the key's value.
func startFloor(b *testing.B, store benchStore, endpoint, medium string) (dir string) {
	b.Helper()
	dir = filepath.Join(b.TempDir(), "floor")
	if err := os.Mkdir(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	if medium == "tmpfs" {
		if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=4m,mode=0755"); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	}
	key := store.prefix + "key-00000"
	if err := store.put(key, "floor start"); err != nil {
		b.Fatal(err)
	}
	kind := "etcd"
	if strings.HasPrefix(store.source, "type = \"consul\"") {
		kind = "consul"
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), floorEnv+"="+strings.Join([]string{kind, endpoint, key, dir, medium}, "|"))
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	for deadline := time.Now().Add(waitTimeout); ; time.Sleep(10 * time.Millisecond) {
		if data, err := os.ReadFile(filepath.Join(dir, "key-00000")); err == nil && string(data) == "floor start" {
			return dir
		}
		if time.Now().After(deadline) {
			b.Fatal("the floor process never showed the key")
		}
	}
}

// floorMain is the floor process: spec is floorEnv's value. It runs until
// SIGTERM or an error, which it prints before exiting 1.
func floorMain(spec string) {
	f := strings.Split(spec, "|")
	if len(f) != 5 {
		fmt.Fprintf(os.Stderr, "floor: %s = %q: want 5 fields\n", floorEnv, spec)
		os.Exit(2)
	}
	store, endpoint, key, dir, medium := f[0], f[1], f[2], f[3], f[4]
	w := &floorWriter{dir: dir, fsync: medium == "disk"}
	var err error
	switch store {
	case "etcd":
		err = floorEtcd(endpoint, key, w)
	case "consul":
		err = floorConsul(endpoint, key, w)
	default:
		err = fmt.Errorf("unknown store %q", store)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// floorEtcd reads key once, then switches w to every value its watch
// delivers.
func floorEtcd(endpoint, key string, w *floorWriter) error {
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{endpoint}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return err
	}
	defer cli.Close()
	resp, err := cli.Get(context.Background(), key)
	if err != nil {
		return err
	}
	if len(resp.Kvs) > 0 {
		if err := w.switchTo(key, resp.Kvs[0].Value); err != nil {
			return err
		}
	}
	for wr := range cli.Watch(context.Background(), key, clientv3.WithRev(resp.Header.Revision+1)) {
		if err := wr.Err(); err != nil {
			return err
		}
		for _, ev := range wr.Events {
			if err := w.switchTo(key, ev.Kv.Value); err != nil {
				return err
			}
		}
	}
	return errors.New("the watch ended")
}

// floorConsul follows key with blocking queries, switching w to each new
// value.
func floorConsul(address, key string, w *floorWriter) error {
	client, err := api.NewClient(&api.Config{Address: address})
	if err != nil {
		return err
	}
	var index uint64
	for {
		pair, meta, err := client.KV().Get(key, &api.QueryOptions{WaitIndex: index, WaitTime: time.Minute})
		if err != nil {
			return err
		}
		if meta.LastIndex == index {
			continue
		}
		index = meta.LastIndex
		if pair != nil {
			if err := w.switchTo(key, pair.Value); err != nil {
				return err
			}
		}
	}
}

// floorWriter switches a directory to a new version of one file, as the
// atomic writer does and with nothing else.
type floorWriter struct {
	dir   string
	fsync bool
	n     int
	last  string // the version directory ..data points to
}

// switchTo writes value as key's base name into a new version directory
// and renames ..data onto it; the visible name is a symlink through
// ..data, made once. The version it replaced is removed after the switch.
func (w *floorWriter) switchTo(key string, value []byte) error {
	w.n++
	version := fmt.Sprintf("..v%d", w.n)
	name := filepath.Base(key)
	vdir := filepath.Join(w.dir, version)
	if err := os.Mkdir(vdir, 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(vdir, name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(value); err != nil {
		f.Close()
		return err
	}
	if w.fsync {
		if err := f.Sync(); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	if w.fsync {
		if err := syncDir(vdir); err != nil {
			return err
		}
	}
	tmp := filepath.Join(w.dir, "..data_tmp")
	if err := os.Symlink(version, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, filepath.Join(w.dir, "..data")); err != nil {
		return err
	}
	if w.fsync {
		if err := syncDir(w.dir); err != nil {
			return err
		}
	}
	if w.last == "" {
		if err := os.Symlink(filepath.Join("..data", name), filepath.Join(w.dir, name)); err != nil {
			return err
		}
	} else if err := os.RemoveAll(filepath.Join(w.dir, w.last)); err != nil {
		return err
	}
	w.last = version
	return nil
}

// syncDir fsyncs the directory dir.
func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}
