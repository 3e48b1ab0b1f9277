package privsep

import (
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvmount/kvmount/internal/roottest"
)

// testEcho writes back each read from its socket to the monitor (fd 3, as
// a worker's), until the socket closes.
func testEcho() error {
	conn := WorkerConn()
	buf := make([]byte, 64)
	for {
		n, err := conn.Read(buf)
		if err != nil {
			return nil
		}
		if _, err := conn.Write(buf[:n]); err != nil {
			return nil
		}
	}
}

// wakeIdle is how long both sides wait before each round trip: about the
// time between the updates of BenchmarkPutToFile, long enough for the
// CPUs to go idle.
const wakeIdle = time.Millisecond

// BenchmarkWakeUp is the floor the privilege separation adds to an
// update: a message to another process that waits for it, over a
// socketpair — the monitor's end non-blocking, in Go's poller, as the
// Supervisor's — beside the same hand-off between two goroutines of one
// process, as the daemon's sources hand a change to its loop. Each round
// trip follows wakeIdle of idleness. It reports half the round trip's p50
// and p90 (one way), in µs.
//
// "process-spinning" is the round trip with the monitor's end awake: it
// reads without waiting until the answer is there, as a monitor that a
// worker woke ahead of its frame would have to, so that only the echo is
// woken from sleep. It measures what such an early wake-up could take
// back (BENCHMARKS.md, "The split's own floor").
func BenchmarkWakeUp(b *testing.B) {
	b.Run("process", func(b *testing.B) {
		mine := startEcho(b)
		buf := make([]byte, 64)
		reportOneWay(b, func() {
			if _, err := mine.Write([]byte("x")); err != nil {
				b.Fatal(err)
			}
			if _, err := mine.Read(buf); err != nil {
				b.Fatal(err)
			}
		})
	})
	b.Run("process-spinning", func(b *testing.B) {
		mine := startEcho(b)
		raw, err := mine.SyscallConn()
		if err != nil {
			b.Fatal(err)
		}
		buf := make([]byte, 64)
		var n int
		var rerr error
		readNow := func(fd uintptr) bool {
			n, rerr = unix.Read(int(fd), buf)
			return true // never wait in the poller
		}
		reportOneWay(b, func() {
			if _, err := mine.Write([]byte("x")); err != nil {
				b.Fatal(err)
			}
			for deadline := time.Now().Add(time.Second); ; {
				if err := raw.Read(readNow); err != nil {
					b.Fatal(err)
				}
				if n > 0 {
					return
				}
				if rerr != unix.EAGAIN || time.Now().After(deadline) {
					b.Fatalf("read: %d, %v", n, rerr)
				}
			}
		})
	})
	b.Run("goroutine", func(b *testing.B) {
		ping, pong := make(chan struct{}), make(chan struct{})
		go func() {
			for range ping {
				pong <- struct{}{}
			}
		}()
		defer close(ping)
		reportOneWay(b, func() {
			ping <- struct{}{}
			<-pong
		})
	})
}

// startEcho starts the test binary as an echo (testEcho) on the other end
// of a socketpair and returns this end, non-blocking; the echo ends when
// the benchmark does.
func startEcho(b *testing.B) *os.File {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	if err := unix.SetNonblock(fds[0], true); err != nil {
		b.Fatal(err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "monitor"), os.NewFile(uintptr(fds[1]), "worker")
	cmd := exec.Command("/proc/self/exe", "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Dir = "/"
	cmd.Env = []string{roottest.HelperEnv + "=echo"}
	cmd.ExtraFiles = []*os.File{theirs}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	theirs.Close()
	b.Cleanup(func() {
		mine.Close() // the echo ends
		_ = cmd.Wait()
	})
	return mine
}

// reportOneWay times b.N round trips, each after wakeIdle, and reports
// half their p50 and p90 in µs.
func reportOneWay(b *testing.B, roundTrip func()) {
	d := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		time.Sleep(wakeIdle)
		b.StartTimer()
		start := time.Now()
		roundTrip()
		d = append(d, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(d)
	oneWay := func(p float64) float64 {
		return float64(d[min(len(d)-1, int(p*float64(len(d))))]) / 2 / float64(time.Microsecond)
	}
	b.ReportMetric(oneWay(0.5), "one-way-p50-us")
	b.ReportMetric(oneWay(0.9), "one-way-p90-us")
}
