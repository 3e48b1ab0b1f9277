package projector

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

// powerCutPayload is the payload of generation g: a file naming g, which
// every generation changes, and files in the version's top and in a
// subdirectory that change every one, two or three generations, so that a
// write both writes files and links unchanged ones.
func powerCutPayload(g int) Payload {
	p := Payload{"gen": file(strconv.Itoa(g), 0o644)}
	for i := range 12 {
		every := i%3 + 1
		name := fmt.Sprintf("k%02d", i)
		if i >= 8 {
			name = "sub/" + name
		}
		p[name] = file(fmt.Sprintf("%s@%d", name, g-g%every), 0o644)
	}
	return p
}

// TestPowerCut cuts the power under the atomic writer: an ext4 file system
// on a loop device is shut down at a random point of a run of writes
// without committing its journal (EXT4_IOC_SHUTDOWN, NOLOGFLUSH), then
// mounted again, which replays what the journal had committed. Each time,
// ..data must name one whole version with its manifest, adopted from the
// manifest, and no older than the last write that returned: a version the
// writer reported written survives the cut. It fails with WriterOptions.Sync
// off.
func TestPowerCut(t *testing.T) {
	disk := roottest.NewPowerCutFS(t, "64M")
	dir := filepath.Join(disk.Dir, "mount")
	manifests := dir + ".manifests" // where checkMount looks
	acked, attempted, cuts, inFlight := -1, -1, 0, 0
	for round := range 30 {
		if round > 0 {
			disk.Mount()
		}
		for _, d := range []string{dir, manifests} {
			if err := os.MkdirAll(d, 0o700); err != nil {
				t.Fatal(err)
			}
		}
		w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifests, Sync: true, DirUID: -1, DirGID: -1})
		if err != nil {
			t.Fatalf("round %d: open: %v", round, err)
		}
		ad, err := w.Adopt()
		if err != nil {
			t.Fatalf("round %d: adopt after the cut: %v", round, err)
		}
		if g := powerCutGeneration(t, dir); g < acked || g > attempted {
			t.Fatalf("round %d: ..data holds generation %d after the cut; the last write that returned wrote %d, the last begun %d", round, g, acked, attempted)
		} else if g >= 0 {
			checkMount(t, dir, powerCutPayload(g))
			if !ad.FromManifest {
				t.Fatalf("round %d: generation %d adopted without its manifest: %v", round, g, ad.ManifestErr)
			}
			if g > acked {
				inFlight++
			}
			acked = g
		}
		// The next writes, until the cut lands.
		cut := make(chan error, 1)
		go func() {
			time.Sleep(time.Duration(2+rand.IntN(25)) * time.Millisecond)
			cut <- disk.CutPower()
		}()
		for {
			attempted++
			if _, err := w.Write(powerCutPayload(attempted)); err != nil {
				if !errors.Is(err, unix.EIO) {
					t.Logf("round %d: write of generation %d: %v", round, attempted, err)
				}
				break
			}
			acked = attempted
		}
		if err := <-cut; err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		cuts++
		_ = w.Close()
		disk.Unmount()
	}
	t.Logf("%d cuts; last generation written %d; %d times the write in flight survived", cuts, acked, inFlight)
}

// powerCutGeneration returns the generation the version ..data names in
// dir holds, -1 when there is no ..data.
func powerCutGeneration(t *testing.T, dir string) int {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, DataDirName, "gen"))
	if errors.Is(err, fs.ErrNotExist) {
		if _, lerr := os.Lstat(filepath.Join(dir, DataDirName)); errors.Is(lerr, fs.ErrNotExist) {
			return -1
		}
	}
	if err != nil {
		t.Fatalf("after the cut: %v", err)
	}
	g, err := strconv.Atoi(string(data))
	if err != nil {
		t.Fatalf("after the cut, gen holds %q", data)
	}
	return g
}
