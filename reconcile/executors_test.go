package reconcile

import (
	goruntime "runtime"
	"sync"
	"testing"
	"time"
)

// settle waits (at most 10 s) until at most want executors of e are
// alive, and returns how many are.
func settle(e *executors, want int32) int32 {
	deadline := time.Now().Add(10 * time.Second)
	for e.live.Load() > want && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	return e.live.Load()
}

// TestExecutorsKeepAFewWaiting: operations one after another run on one
// goroutine; a burst of 100 at once runs on 100 and leaves at most maxIdle
// waiting; stop ends them all.
func TestExecutorsKeepAFewWaiting(t *testing.T) {
	e := newExecutors()
	done := make(chan int)
	for i := range 20 {
		e.run(func() { done <- i })
		if got := <-done; got != i {
			t.Fatalf("operation %d reported %d", i, got)
		}
		// The executor is about to wait for work again; let it get there
		// (at most 1 s: an executor that never waits is what the check
		// below reports).
		for deadline := time.Now().Add(time.Second); e.idle.Load() == 0 && time.Now().Before(deadline); {
			goruntime.Gosched()
		}
		goruntime.Gosched()
	}
	if n := e.started.Load(); n > 2 {
		t.Fatalf("20 operations one after another started %d executors, want one (two if the first was not yet receiving)", n)
	}

	var wg sync.WaitGroup
	release := make(chan struct{})
	for range 100 {
		wg.Add(1)
		e.run(func() { defer wg.Done(); <-release })
	}
	// The waiting executor takes the first unless it has counted itself
	// idle but not yet reached its receive: then a new one does.
	if n := e.live.Load(); n < 100 || n > 101 {
		t.Fatalf("100 operations at once ran on %d executors, want 100 (101 if the waiting one was not yet receiving)", n)
	}
	close(release)
	wg.Wait()
	if n := settle(e, maxIdle); n > maxIdle || n < 1 {
		t.Fatalf("after a burst of 100 operations %d executors remain, want 1 to %d", n, maxIdle)
	}

	e.stop()
	e.stop()
	if n := settle(e, 0); n != 0 {
		t.Fatalf("after stop %d executors remain", n)
	}
}

// deepOperation uses about 40 KiB of stack: a stand-in for an operation
// that grows its goroutine's stack several times, as a write does.
//
//go:noinline
func deepOperation(depth int) int {
	var frame [512]byte
	frame[depth%len(frame)] = byte(depth)
	if depth == 0 {
		return int(frame[0])
	}
	return deepOperation(depth-1) + int(frame[depth%len(frame)])
}

// BenchmarkOperationGoroutine compares an operation of 40 KiB of stack on a
// goroutine of its own (the reconciler before executors.go) with one
// handed to a waiting executor, side by side in one run.
func BenchmarkOperationGoroutine(b *testing.B) {
	done := make(chan int)
	op := func() { done <- deepOperation(80) }
	b.Run("new", func(b *testing.B) {
		for b.Loop() {
			go op()
			<-done
		}
	})
	b.Run("executor", func(b *testing.B) {
		e := newExecutors()
		defer e.stop()
		for b.Loop() {
			e.run(op)
			<-done
		}
	})
}
