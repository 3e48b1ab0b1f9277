package daemon

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
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
// The split floor is the same program in two processes, as any design
// that keeps the network out of the process that writes must be: the
// watcher reads the store and hands each value over a socketpair to a
// writer process, which switches the directory. The writer's end is
// non-blocking, in Go's poller, as the monitor's end of a worker's is.
// What it adds to the floor is what the privilege separation costs at the
// least, with nothing of kvmount's own in it: one more process woken per
// update, and one write and one read.
//
// The benchmark binary itself is the floor process, started with floorEnv
// set to "STORE|ENDPOINT|KEY|DIR|MEDIUM|FORM" (STORE etcd or consul, FORM
// "one" or "split"); TestMain runs floorMain then and never returns. The
// split floor's writer is the same binary again, with floorEnv set to
// "writer|KEY|DIR|MEDIUM" and its end of the socketpair as fd 3.
const floorEnv = "KVMOUNT_BENCH_FLOOR"

// startFloor starts the floor process of the form ("one", or "split":
// the watcher and the writer in two processes) for store's key
// prefix+key-00000 in a mount directory of the medium ("disk" or "tmpfs":
// a tmpfs is mounted there), and returns the directory once it shows the
// key's value.
func startFloor(b *testing.B, store benchStore, endpoint, medium, form string) (dir string) {
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
	cmd.Env = append(os.Environ(), floorEnv+"="+strings.Join([]string{kind, endpoint, key, dir, medium, form}, "|"))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // not left behind by a benchmark killed
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
	if f[0] == "writer" && len(f) == 4 {
		if err := floorWriterMain(f[1], &floorWriter{dir: f[2], fsync: f[3] == "disk"}); err != nil {
			fmt.Fprintln(os.Stderr, "floor writer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if len(f) != 6 {
		fmt.Fprintf(os.Stderr, "floor: %s = %q: want 6 fields\n", floorEnv, spec)
		os.Exit(2)
	}
	store, endpoint, key, dir, medium, form := f[0], f[1], f[2], f[3], f[4], f[5]
	var w switcher = &floorWriter{dir: dir, fsync: medium == "disk"}
	var err error
	if form == "split" {
		w, err = startFloorWriter(key, dir, medium)
	}
	switch {
	case err != nil:
	case store == "etcd":
		err = floorEtcd(endpoint, key, w)
	case store == "consul":
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
func floorEtcd(endpoint, key string, w switcher) error {
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
func floorConsul(address, key string, w switcher) error {
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

// switcher switches the floor's directory to each new value of its key.
type switcher interface {
	switchTo(key string, value []byte) error
}

// floorHandOff is the split floor's watcher's end: it hands each value to
// the writer process, framed as its length (4 bytes, big-endian) and its
// bytes, in one write.
type floorHandOff struct {
	conn  *os.File
	frame []byte
}

// startFloorWriter starts the split floor's writer process for key in dir
// and returns the watcher's end of the socketpair to it. The writer ends
// when that end closes, as when the watcher exits.
func startFloorWriter(key, dir, medium string) (*floorHandOff, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "floor watcher"), os.NewFile(uintptr(fds[1]), "floor writer")
	defer theirs.Close()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), floorEnv+"="+strings.Join([]string{"writer", key, dir, medium}, "|"))
	cmd.Stderr = os.Stderr
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		mine.Close()
		return nil, err
	}
	return &floorHandOff{conn: mine}, nil
}

func (h *floorHandOff) switchTo(_ string, value []byte) error {
	h.frame = binary.BigEndian.AppendUint32(h.frame[:0], uint32(len(value)))
	h.frame = append(h.frame, value...)
	_, err := h.conn.Write(h.frame)
	return err
}

// floorWriterMain is the split floor's writer: it reads the values the
// watcher hands it on fd 3, made non-blocking so that Go's poller waits
// for them, and switches w to each, until the watcher's end closes.
func floorWriterMain(key string, w *floorWriter) error {
	if err := unix.SetNonblock(3, true); err != nil {
		return err
	}
	conn := bufio.NewReader(os.NewFile(3, "floor watcher"))
	var size [4]byte
	for {
		if _, err := io.ReadFull(conn, size[:]); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		value := make([]byte, binary.BigEndian.Uint32(size[:]))
		if _, err := io.ReadFull(conn, value); err != nil {
			return err
		}
		if err := w.switchTo(key, value); err != nil {
			return err
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
