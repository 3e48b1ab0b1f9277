package admin

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// TestWorkerStatus: Options.Workers is served in /status and as the
// kvmount_worker_* metrics, a series per trust domain, read again at
// each request; without it neither appears.
func TestWorkerStatus(t *testing.T) {
	w := &WorkerStatus{Domain: "etcd", Sources: []string{"etcd"}, Mounts: []string{"app"}, Running: true, PID: 4242, UID: 61184, Starts: 1, LandlockABI: 7, Seccomp: true, NoNewPrivs: true}
	other := &WorkerStatus{Domain: "vault", Running: true, PID: 4243, Starts: 3, Payloads: 5, Unchanged: 995}
	s := New(Options{Workers: func() []*WorkerStatus { c, o := *w, *other; return []*WorkerStatus{&c, &o} }})
	h := s.Handler()
	_, body := get(t, h, "/status")
	var st Status
	if err := json.Unmarshal([]byte(body), &st); err != nil || len(st.Workers) != 2 || st.Workers[0].PID != 4242 || !st.Workers[0].Seccomp || st.Workers[0].Domain != "etcd" {
		t.Fatalf("/status: %v\n%s", err, body)
	}
	for _, want := range []string{`kvmount_worker_up{domain="etcd"} 1`, `kvmount_worker_starts_total{domain="etcd"} 1`, `kvmount_worker_refusals_total{domain="etcd"} 0`,
		`kvmount_worker_landlock_abi{domain="etcd"} 7`, `kvmount_worker_seccomp{domain="etcd"} 1`, `kvmount_worker_starts_total{domain="vault"} 3`,
		`kvmount_worker_payloads_total{domain="vault",form="whole"} 5`, `kvmount_worker_payloads_total{domain="vault",form="unchanged"} 995`} {
		if _, metrics := get(t, h, "/metrics"); !strings.Contains(metrics, want+"\n") {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// The worker ended, and was refused once.
	w.Running, w.PID, w.Starts, w.Refusals, w.LastEnd = false, 0, 2, 1, "refused"
	_, metrics := get(t, h, "/metrics")
	for _, want := range []string{`kvmount_worker_up{domain="etcd"} 0`, `kvmount_worker_starts_total{domain="etcd"} 2`, `kvmount_worker_refusals_total{domain="etcd"} 1`, `kvmount_worker_seccomp{domain="etcd"} 0`} {
		if !strings.Contains(metrics, want+"\n") {
			t.Errorf("/metrics lacks %q", want)
		}
	}

	plain := New(Options{}).Handler()
	if code, body := get(t, plain, "/status"); code != http.StatusOK || strings.Contains(body, `"workers"`) {
		t.Errorf("/status without a worker: %d\n%s", code, body)
	}
	if _, metrics := get(t, plain, "/metrics"); strings.Contains(metrics, "kvmount_worker_") {
		t.Errorf("/metrics without a worker has its series")
	}
}
