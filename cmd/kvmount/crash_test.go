package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// crashKeys is how many keys the crash test's transactions rewrite at
// once: enough that a write takes a while and kills land inside writes.
const crashKeys = 40

// leftovers returns the version directories and ..data_tmp in dir that
// ..data does not name: what an interrupted write leaves.
func leftovers(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	current, _ := os.Readlink(filepath.Join(dir, "..data"))
	var out []string
	for _, e := range entries {
		if name := e.Name(); strings.HasPrefix(name, "..") && name != "..data" && name != current {
			out = append(out, name)
		}
	}
	return out
}

// checkComplete asserts that ..data names a complete version: every key,
// all from one transaction. It returns that transaction's value, or "" when
// nothing was ever projected.
func checkComplete(t *testing.T, dir string) string {
	t.Helper()
	current, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		return ""
	}
	entries, err := os.ReadDir(filepath.Join(dir, current))
	if err != nil {
		t.Fatalf("..data names %s, which cannot be read: %v", current, err)
	}
	if len(entries) != crashKeys {
		t.Fatalf("version %s holds %d files; want %d", current, len(entries), crashKeys)
	}
	var value string
	for i := range crashKeys {
		name := fmt.Sprintf("k%02d", i)
		data, err := os.ReadFile(filepath.Join(dir, current, name))
		if err != nil {
			t.Fatalf("version %s: %v", current, err)
		}
		if i == 0 {
			value = string(data)
		} else if string(data) != value {
			t.Fatalf("version %s mixes transactions: k00=%q %s=%q", current, value, name, data)
		}
		// The visible name reaches the same version.
		if visible, err := os.ReadFile(filepath.Join(dir, name)); err != nil {
			t.Fatalf("visible %s: %v", name, err)
		} else if string(visible) != string(data) {
			// A restart may have switched meanwhile only if a daemon
			// runs; none does here.
			t.Fatalf("visible %s = %q; version holds %q", name, visible, data)
		}
	}
	return value
}

// TestCrashConsistency kills the real daemon with SIGKILL at random moments
// while transactions stream in, 200 times, restarting it each time: the
// mount always holds exactly one complete version, what a killed write left
// is gone after the next start, and the content converges on the last
// transaction.
func TestCrashConsistency(t *testing.T) {
	const kills = 200
	e := newEnv(t)
	txn := func(value string) error {
		ops := make([]clientv3.Op, crashKeys)
		for i := range ops {
			ops[i] = clientv3.OpPut(fmt.Sprintf("/app/k%02d", i), value)
		}
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		_, err := e.cli.Txn(ctx).Then(ops...).Commit()
		return err
	}
	if err := txn("v0"); err != nil {
		t.Fatal(err)
	}
	e.writeConfig("app")
	dir := e.dir("app")

	// The stream of transactions, until stopped.
	var mu sync.Mutex
	last := 0
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(rand.IntN(8)) * time.Millisecond):
			}
			if err := txn(fmt.Sprintf("v%d", i)); err != nil {
				t.Errorf("txn %d: %v", i, err)
				return
			}
			mu.Lock()
			last = i
			mu.Unlock()
		}
	}()
	stopStream := sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})
	defer stopStream()

	deadline := time.Now().Add(10 * time.Minute)
	var before []string // leftovers of the previous kill
	var interrupted, advanced int
	previous := ""
	for kill := range kills {
		if time.Now().After(deadline) {
			t.Fatalf("only %d kills in the time allowed", kill)
		}
		cmd, logs := e.start("run")
		// Whatever the previous kill left must be gone once the restarted
		// daemon has adopted the mount.
		for wait := time.Now().Add(waitTimeout); ; {
			now := leftovers(t, dir)
			if !slices.ContainsFunc(before, func(name string) bool { return slices.Contains(now, name) }) {
				break
			}
			if time.Now().After(wait) {
				t.Fatalf("kill %d: leftovers %v survived the restart; logs:\n%s", kill, now, logs)
			}
			time.Sleep(time.Millisecond)
		}
		// Half the kills land anywhere after the start (reading the store,
		// adopting, writing); the other half after the restarted daemon
		// has projected something, inside the stream of writes that
		// follows, so that the content is sure to move on.
		awaited := "kvmount started"
		if kill%2 == 1 {
			awaited = "msg=projected"
		}
		for wait := time.Now().Add(waitTimeout); !strings.Contains(logs.String(), awaited); {
			if time.Now().After(wait) {
				t.Fatalf("kill %d: no %q from the daemon; logs:\n%s", kill, awaited, logs)
			}
			time.Sleep(time.Millisecond)
		}
		time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
		value := checkComplete(t, dir)
		if value != previous {
			advanced++
		}
		previous = value
		before = leftovers(t, dir)
		if len(before) > 0 {
			interrupted++
		}
	}
	t.Logf("%d kills: %d interrupted a write (left a partial version or ..data_tmp), %d found newer content than the kill before", kills, interrupted, advanced)
	if interrupted == 0 || advanced < kills/4 {
		t.Errorf("the kills did not exercise writes: %d interrupted, %d advanced", interrupted, advanced)
	}
	stopStream()
	mu.Lock()
	final := fmt.Sprintf("v%d", last)
	mu.Unlock()

	cmd, logs := e.start("run")
	for wait := time.Now().Add(waitTimeout); ; {
		if value := checkCompleteQuiet(dir); value == final && len(leftovers(t, dir)) == 0 {
			break
		}
		if time.Now().After(wait) {
			t.Fatalf("content did not converge on %s: ..data holds %q, leftovers %v; logs:\n%s", final, checkCompleteQuiet(dir), leftovers(t, dir), logs)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit %v; logs:\n%s", err, logs)
	}
	checkComplete(t, dir)
}

// checkCompleteQuiet returns the value of the version ..data names when
// it is complete and from one transaction, else "".
func checkCompleteQuiet(dir string) string {
	current, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		return ""
	}
	var value string
	for i := range crashKeys {
		data, err := os.ReadFile(filepath.Join(dir, current, fmt.Sprintf("k%02d", i)))
		if err != nil || (i > 0 && string(data) != value) {
			return ""
		}
		value = string(data)
	}
	return value
}
