package projector

import (
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestSyncBatchesBoundTheirGoroutines flushes 100 batches of eight
// directories at once, their fsyncs held until all have started: at most
// maxSyncGoroutines fsync on goroutines of their own, each batch's others
// on its writer's goroutine, and every fsync is done when its flush
// returns. A batch alone fsyncs its eight together, as before.
func TestSyncBatchesBoundTheirGoroutines(t *testing.T) {
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	var inFlight, most, done atomic.Int64
	release := make(chan struct{})
	syncFile = func(*os.File) error {
		n := inFlight.Add(1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		<-release
		inFlight.Add(-1)
		done.Add(1)
		return nil
	}
	t.Cleanup(func() { syncFile = (*os.File).Sync })

	flushAll := func(batches int) {
		t.Helper()
		var wg sync.WaitGroup
		for range batches {
			wg.Go(func() {
				var b syncBatch
				for range syncBatchSize - 1 {
					b.dirs = append(b.dirs, queuedDir{dir, "d"})
				}
				before := done.Load()
				if err := b.addDir(dir, "d"); err != nil { // the eighth: the batch is flushed
					t.Error(err)
				}
				if done.Load()-before < syncBatchSize && batches == 1 {
					t.Errorf("the flush returned with %d of its fsyncs done", done.Load()-before)
				}
			})
		}
		// Every fsync that can start has: each batch's inline one and
		// those on goroutines.
		want := int64(min(batches*syncBatchSize, batches+maxSyncGoroutines))
		for deadline := time.Now().Add(10 * time.Second); inFlight.Load() < want; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d fsyncs started, want %d", inFlight.Load(), want)
			}
		}
		goroutines := runtime.NumGoroutine()
		close(release)
		wg.Wait()
		release = make(chan struct{})
		if batches > 1 {
			// The test's own goroutines, one per batch, and the slots.
			if extra := goroutines - batches; extra > maxSyncGoroutines+10 {
				t.Errorf("%d batches at once ran %d goroutines beside their writers', more than %d", batches, extra, maxSyncGoroutines)
			}
		}
	}

	flushAll(1)
	if got := most.Load(); got != syncBatchSize {
		t.Errorf("a batch alone: %d fsyncs at once, want %d", got, syncBatchSize)
	}
	most.Store(0)
	done.Store(0)
	flushAll(100)
	if got, want := most.Load(), int64(100+maxSyncGoroutines); got != want {
		t.Errorf("100 batches at once: %d fsyncs at once, want %d (one on each writer's goroutine and %d on their own)", got, want, maxSyncGoroutines)
	}
	if got := done.Load(); got != 100*syncBatchSize {
		t.Errorf("%d fsyncs done, want %d", got, 100*syncBatchSize)
	}
}
