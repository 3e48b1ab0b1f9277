package main

import (
	"context"
	"encoding/json"
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
	return leftoversQuiet(dir)
}

// checkComplete asserts that ..data names a complete version: every key,
// all from one transaction. It returns that transaction's value, or "" when
// nothing was ever projected — which fails the test once projected is set.
func checkComplete(t *testing.T, dir string, projected bool) string {
	t.Helper()
	current, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		if projected {
			t.Fatalf("..data is unreadable after a projection: %v", err)
		}
		return ""
	}
	entries, err := os.ReadDir(filepath.Join(dir, current))
	if err != nil {
		t.Fatalf("..data names %s, which cannot be read: %v", current, err)
	}
	if len(entries) != crashKeys {
		t.Fatalf("version %s holds %d files; want %d", current, len(entries), crashKeys)
	}
	// The manifest belongs to its version: whole, listing every key.
	if m, err := readCrashManifest(dir, current); err != nil {
		t.Fatalf("version %s: %v", current, err)
	} else if len(m.Files) != crashKeys {
		t.Fatalf("version %s: the manifest lists %d files; want %d", current, len(m.Files), crashKeys)
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

// manifestOf returns the path of the manifest of the version directory
// version of the mount directory dir: in the state directory beside the
// mounts (newEnv's layout), named after the version without its "..".
func manifestOf(dir, version string) string {
	return filepath.Join(filepath.Dir(filepath.Dir(dir)), "state", "manifests", filepath.Base(dir), strings.TrimPrefix(version, ".."))
}

// readCrashManifest reads the manifest of version in the mount directory
// dir.
func readCrashManifest(dir, version string) (*struct{ Files []json.RawMessage }, error) {
	data, err := os.ReadFile(manifestOf(dir, version))
	if err != nil {
		return nil, err
	}
	var m struct{ Files []json.RawMessage }
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("the manifest is torn: %w", err)
	}
	return &m, nil
}

// tornManifest reports whether a version directory in dir other than the
// one ..data names holds a manifest that is not whole yet: a write held
// by KVMOUNT_TEST_MANIFEST_PAUSE half way.
func tornManifest(dir string) bool {
	for _, name := range leftoversQuiet(dir) {
		if data, err := os.ReadFile(manifestOf(dir, name)); err == nil && !json.Valid(data) {
			return true
		}
	}
	return false
}

// txnNumber returns N of a value "vN", or -1.
func txnNumber(value string) int {
	var n int
	if _, err := fmt.Sscanf(value, "v%d", &n); err != nil {
		return -1
	}
	return n
}

// killed classifies what a SIGKILL left in dir beside the version ..data
// names: ..data_tmp (killed between creating it and the rename), a partial
// version (killed while building one), or a complete version newer than the
// current one (killed between building and switching). Older complete
// versions are the ones kept for readers, not an interrupted write.
func killed(dir string) (inWrite, atSwitch bool) {
	current, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		return false, false
	}
	now := txnNumber(checkCompleteQuietAt(dir, current))
	for _, name := range leftoversQuiet(dir) {
		if name == "..data_tmp" {
			return true, true
		}
		if v := checkCompleteQuietAt(dir, name); v == "" || txnNumber(v) > now {
			inWrite = true
		}
	}
	return inWrite, false
}

// TestCrashConsistency kills the real daemon with SIGKILL at random moments
// while transactions stream in, 200 times, restarting it each time: the
// mount always holds exactly one complete version behind ..data, never an
// older transaction than before, what a killed write left is gone after the
// next start, every restart catches up with the transactions made before
// it, and the content converges on the last transaction. Every fifth kill
// is aimed between ..data_tmp and the rename, and every fifth another one
// while a version's manifest is half written (see projector's crash-test
// hooks); the others land at random, and the test requires a share of
// them inside writes.
func TestCrashConsistency(t *testing.T) {
	const kills = 200
	e := newEnv(t)
	if err := crashTxn(e, "v0"); err != nil {
		t.Fatal(err)
	}
	e.writeConfig("app")
	dir := e.dir("app")
	stream := startCrashStream(t, e)
	defer stream.stop()

	deadline := time.Now().Add(10 * time.Minute)
	var before []string // leftovers of the previous kill
	var interrupted, atSwitch, atManifest, advanced int
	previous := ""
	for kill := range kills {
		if time.Now().After(deadline) {
			t.Fatalf("only %d kills in the time allowed", kill)
		}
		committed := stream.last() // made before this start: the daemon must catch up
		aim, aimManifest := kill%5 == 4, kill%5 == 2
		var environ []string
		switch {
		case aim:
			environ = []string{"KVMOUNT_TEST_SWITCH_PAUSE=30ms"}
		case aimManifest:
			environ = []string{"KVMOUNT_TEST_MANIFEST_PAUSE=30ms"}
		}
		cmd, logs := e.startEnv(environ, "run")
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
		switch {
		case aim:
			// Kill while ..data_tmp waits for its rename.
			for wait := time.Now().Add(waitTimeout); ; {
				if _, err := os.Lstat(filepath.Join(dir, "..data_tmp")); err == nil {
					break
				}
				if time.Now().After(wait) {
					t.Fatalf("kill %d: no ..data_tmp appeared; logs:\n%s", kill, logs)
				}
				time.Sleep(200 * time.Microsecond)
			}
		case aimManifest:
			// Kill while a new version's manifest is half written.
			for wait := time.Now().Add(waitTimeout); !tornManifest(dir); {
				if time.Now().After(wait) {
					t.Fatalf("kill %d: no manifest was seen half written; logs:\n%s", kill, logs)
				}
				time.Sleep(200 * time.Microsecond)
			}
		case kill%2 == 1:
			// Once the restarted daemon has caught up with what was
			// committed before it started, inside the stream of writes
			// that follows.
			for wait := time.Now().Add(waitTimeout); txnNumber(checkCompleteQuiet(dir)) < committed; {
				if time.Now().After(wait) {
					t.Fatalf("kill %d: the restarted daemon never caught up with v%d (holds %q); logs:\n%s", kill, committed, checkCompleteQuiet(dir), logs)
				}
				time.Sleep(time.Millisecond)
			}
			time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
		default:
			// Anywhere after the start: reading the store, adopting,
			// writing.
			for wait := time.Now().Add(waitTimeout); !strings.Contains(logs.String(), "kvmount started"); {
				if time.Now().After(wait) {
					t.Fatalf("kill %d: the daemon never started; logs:\n%s", kill, logs)
				}
				time.Sleep(time.Millisecond)
			}
			time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
		}
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
		value := checkComplete(t, dir, previous != "")
		if value != previous {
			advanced++
		}
		if previous != "" && txnNumber(value) < txnNumber(previous) {
			t.Fatalf("kill %d: the mount went back from %s to %s", kill, previous, value)
		}
		previous = value
		before = leftovers(t, dir)
		inWrite, switching := killed(dir)
		if inWrite {
			interrupted++
		}
		if switching {
			atSwitch++
		} else if aim {
			t.Errorf("kill %d was aimed between ..data_tmp and the rename but left no ..data_tmp", kill)
		}
		if aimManifest {
			if !tornManifest(dir) {
				t.Errorf("kill %d was aimed at a half-written manifest but left none", kill)
			}
			atManifest++
		}
	}
	t.Logf("%d kills: %d interrupted a write, %d of them between ..data_tmp and the rename, %d in a manifest; %d found newer content than the kill before", kills, interrupted, atSwitch, atManifest, advanced)
	if interrupted < kills/4 || atSwitch < kills/5 || advanced < kills/4 {
		t.Errorf("the kills did not exercise writes: %d interrupted (want ≥ %d), %d at the switch (want ≥ %d), %d advanced (want ≥ %d)", interrupted, kills/4, atSwitch, kills/5, advanced, kills/4)
	}
	stream.stop()
	final := fmt.Sprintf("v%d", stream.last())

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
	checkComplete(t, dir, true)
}

// crashTxn commits one transaction that sets every one of the crashKeys
// keys under /app/ to value.
func crashTxn(e *env, value string) error {
	ops := make([]clientv3.Op, crashKeys)
	for i := range ops {
		ops[i] = clientv3.OpPut(fmt.Sprintf("/app/k%02d", i), value)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	_, err := e.cli.Txn(ctx).Then(ops...).Commit()
	return err
}

// crashStream commits transactions (crashTxn) of "v1", "v2", ... one
// every 0–8 ms, from a goroutine of its own, until stopped.
type crashStream struct {
	mu      sync.Mutex
	n       int
	done    chan struct{}
	wg      sync.WaitGroup
	stopped func()
}

// startCrashStream starts a crashStream; a failed transaction fails t.
func startCrashStream(t *testing.T, e *env) *crashStream {
	s := &crashStream{done: make(chan struct{})}
	s.stopped = sync.OnceFunc(func() {
		close(s.done)
		s.wg.Wait()
	})
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for i := 1; ; i++ {
			select {
			case <-s.done:
				return
			case <-time.After(time.Duration(rand.IntN(8)) * time.Millisecond):
			}
			if err := crashTxn(e, fmt.Sprintf("v%d", i)); err != nil {
				t.Errorf("txn %d: %v", i, err)
				return
			}
			s.mu.Lock()
			s.n = i
			s.mu.Unlock()
		}
	}()
	return s
}

// last returns N of the last transaction committed.
func (s *crashStream) last() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

// stop ends the stream and waits for its last transaction; it may be
// called again.
func (s *crashStream) stop() { s.stopped() }

// checkCompleteQuiet returns the value of the version ..data names when
// it is complete and from one transaction, else "".
func checkCompleteQuiet(dir string) string {
	current, err := os.Readlink(filepath.Join(dir, "..data"))
	if err != nil {
		return ""
	}
	return checkCompleteQuietAt(dir, current)
}

// leftoversQuiet is leftovers without a test.
func leftoversQuiet(dir string) []string {
	entries, _ := os.ReadDir(dir)
	current, _ := os.Readlink(filepath.Join(dir, "..data"))
	var out []string
	for _, e := range entries {
		if name := e.Name(); strings.HasPrefix(name, "..") && name != "..data" && name != current {
			out = append(out, name)
		}
	}
	return out
}

// checkCompleteQuietAt returns the value of the version directory name
// when it is complete and from one transaction, else "".
func checkCompleteQuietAt(dir, current string) string {
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
