package main

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
)

// TestPowerCutDaemon runs the kvmount binary with its state directory and
// a disk mount on an ext4 that loses power (roottest.PowerCutFS: shut down
// without committing its journal) while transactions stream in, 10 times,
// at a random moment once the daemon has caught up (and, before the first
// cut, once its first projection is durable); the file system is
// then mounted again (the kernel replays its journal) and the daemon
// started again. Each time ..data names one whole version with its
// manifest, never older than what survived the cut before; the restarted
// daemon finds its record of the mount (mounts.json), adopts the version
// from its manifest, removes what the cut left half written, and catches up
// with the transactions made before it started.
func TestPowerCutDaemon(t *testing.T) {
	const cuts = 10
	e := newEnv(t)
	disk := roottest.NewPowerCutFS(t, "128M")
	// The configuration and the admin socket stay off the file system
	// that loses power; the state directory and the mount are on it.
	dir := filepath.Join(disk.Dir, "mnt", "app") // checkComplete finds the manifests in ../../state
	config := fmt.Sprintf("state_dir = %q\nlog_level = \"debug\"\n[admin]\naddress = \"\"\nsocket = %q\n[sources.main]\ntype = \"etcd\"\nendpoints = [%q]\n"+
		"[[mount]]\nname = \"app\"\ndir = %q\nsource = \"main\"\nprefix = \"/app/\"\n", filepath.Join(disk.Dir, "state"), e.socket(), e.etcd.Endpoint(), dir)
	if err := os.WriteFile(e.config, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := crashTxn(e, "v0"); err != nil {
		t.Fatal(err)
	}
	stream := startCrashStream(t, e)
	defer stream.stop()

	survived := "" // what the last cut left: durable
	var before []string
	advanced := 0
	for cut := range cuts {
		committed := stream.last()
		cmd, logs := e.start("run")
		// Before the first cut, the first projection must be durable, not
		// only visible: the rename of ..data is readable before the fsync
		// of the mount directory that makes it last, and a cut in between
		// rightly leaves no ..data, since nothing was promised yet. The
		// daemon logs "projected" once the write, fsync included, returned.
		durable := func() bool { return survived != "" || strings.Contains(logs.String(), "msg=projected mount=app") }
		for wait := time.Now().Add(waitTimeout); txnNumber(checkCompleteQuiet(dir)) < committed || !durable() || slices.ContainsFunc(before, func(name string) bool { return slices.Contains(leftoversQuiet(dir), name) }); {
			if time.Now().After(wait) {
				t.Fatalf("cut %d: the restarted daemon never caught up with v%d (holds %q, leftovers %v; those of the cut %v); logs:\n%s", cut, committed, checkCompleteQuiet(dir), leftoversQuiet(dir), before, logs)
			}
			time.Sleep(time.Millisecond)
		}
		if cut > 0 {
			if !strings.Contains(logs.String(), `msg="adopted the version on disk" mount=app`) || !strings.Contains(logs.String(), "from_manifest=true") ||
				strings.Contains(logs.String(), "does not match it") {
				t.Fatalf("cut %d: the version the cut left was not adopted from its manifest; logs:\n%s", cut-1, logs)
			}
		}
		time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
		if err := disk.CutPower(); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
		disk.Unmount()
		disk.Mount()
		value := checkComplete(t, dir, true)
		if txnNumber(value) < txnNumber(survived) {
			t.Fatalf("cut %d: the mount went back from %s, which an earlier cut left, to %s", cut, survived, value)
		}
		if value != survived {
			advanced++
		}
		survived, before = value, leftoversQuiet(dir)
	}
	t.Logf("%d cuts; %d left newer content than the cut before", cuts, advanced)
	if advanced < cuts/2 {
		t.Errorf("only %d cuts of %d found newer content than the one before: the cuts did not land among writes", advanced, cuts)
	}
}
