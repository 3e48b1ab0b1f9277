package admin

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// TestWorkerStatus: Options.Worker is served in /status and as the
// kvmount_worker_* metrics, read again at each request; without it
// neither appears.
func TestWorkerStatus(t *testing.T) {
	w := &WorkerStatus{Running: true, PID: 4242, UID: 61184, Starts: 1, LandlockABI: 7, Seccomp: true, NoNewPrivs: true}
	s := New(Options{Worker: func() *WorkerStatus { c := *w; return &c }})
	h := s.Handler()
	_, body := get(t, h, "/status")
	var st Status
	if err := json.Unmarshal([]byte(body), &st); err != nil || st.Worker == nil || st.Worker.PID != 4242 || !st.Worker.Seccomp {
		t.Fatalf("/status: %v\n%s", err, body)
	}
	for _, want := range []string{"kvmount_worker_up 1", "kvmount_worker_starts_total 1", "kvmount_worker_refusals_total 0",
		"kvmount_worker_landlock_abi 7", "kvmount_worker_seccomp 1"} {
		if _, metrics := get(t, h, "/metrics"); !strings.Contains(metrics, want+"\n") {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// The worker ended, and was refused once.
	w.Running, w.PID, w.Starts, w.Refusals, w.LastEnd = false, 0, 2, 1, "refused"
	_, metrics := get(t, h, "/metrics")
	for _, want := range []string{"kvmount_worker_up 0", "kvmount_worker_starts_total 2", "kvmount_worker_refusals_total 1", "kvmount_worker_seccomp 0"} {
		if !strings.Contains(metrics, want+"\n") {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	plain := New(Options{}).Handler()
	if code, body := get(t, plain, "/status"); code != http.StatusOK || strings.Contains(body, `"worker"`) {
		t.Errorf("/status without a worker: %d\n%s", code, body)
	}
	if _, metrics := get(t, plain, "/metrics"); strings.Contains(metrics, "kvmount_worker_") {
		t.Errorf("/metrics without a worker has its series")
	}
}
