package daemon

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/kvmount/kvmount/admin"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/privsep"
)

// confinementWarnings says what the worker runs without on a kernel that
// offers c (privsep.Offered): none on one with Landlock ABI 4 or later and
// seccomp.
func confinementWarnings(c privsep.Confinement) []string {
	var out []string
	switch {
	case c.LandlockABI == 0:
		out = append(out, "the kernel offers no Landlock (Linux 5.13 or later, with landlock in the lsm= list): the worker can read whatever its user may, and connect anywhere")
	case c.LandlockABI < 4:
		out = append(out, fmt.Sprintf("the kernel offers Landlock ABI %d, before 4 (Linux 6.7): the worker's file system access is narrowed, its TCP connections are not", c.LandlockABI))
	}
	if !c.Seccomp {
		out = append(out, "the kernel has no seccomp filters: the worker's system calls are not filtered")
	}
	return out
}

// WorkerView says how the unprivileged workers that read cfg's sources
// run on this host — as which users, confined how — and, for each trust
// domain (privsep.Domain), its sources and mounts and line by line what
// is in force for its worker on this kernel (privsep.InForce), for
// kvmount check; and what the kernel lets them run without, as warnings.
// workerGroup is Options.WorkerGroup ("" for WorkerGroup). It returns an
// error when that group is root's.
func WorkerView(cfg *config.Config, workerGroup string) (view string, warnings []string, err error) {
	users, err := newDynamicUsers(workerGroup)
	if err != nil {
		return "", nil, err
	}
	if workerGroup == "" {
		workerGroup = WorkerGroup
	}
	who := fmt.Sprintf("a user of its own each (a free id of systemd's dynamic range, %d–%d, locked as systemd locks DynamicUser= ids), in group %s (gid %d)",
		dynamicFirst, dynamicLast, workerGroup, users.group)
	if users.group < 0 {
		who = fmt.Sprintf("a user of its own each (a free id of systemd's dynamic range, %d–%d, locked as systemd locks DynamicUser= ids), its group the same id: there is no group %s (the packages create it)",
			dynamicFirst, dynamicLast, workerGroup)
	}
	c := privsep.Offered()
	landlock := "no Landlock"
	if c.LandlockABI > 0 {
		landlock = fmt.Sprintf("Landlock ABI %d", c.LandlockABI)
	}
	seccomp := "no seccomp filter"
	if c.Seccomp {
		seccomp = "a seccomp filter"
	}
	domains := privsep.ConfigDomains(cfg)
	view = fmt.Sprintf("worker: the sources are read by unprivileged workers, one per trust domain (%d), as %s, with no capability, no_new_privs, %s and %s",
		len(domains), who, landlock, seccomp)
	for _, name := range slices.Sorted(maps.Keys(domains)) {
		d := domains[name]
		mounts := "no mount"
		if len(d.Mounts) > 0 {
			mounts = "mounts " + strings.Join(d.Mounts, ", ")
		}
		view += fmt.Sprintf("\n  domain %s (sources %s; %s):", name, strings.Join(d.Sources, ", "), mounts)
		if p, err := privsep.PolicyFor(d.Of(cfg)); err == nil {
			for _, line := range privsep.InForce(c, p) {
				view += "\n    " + line
			}
		}
	}
	return view, append(warnings, confinementWarnings(c)...), nil
}

// workersStatus returns the workers' entries in /status, one per trust
// domain: the supervisor's counts, and how the kernel shows each running
// worker in /proc/PID/status.
func (m *monitor) workersStatus() []*admin.WorkerStatus {
	var out []*admin.WorkerStatus
	for _, dw := range m.Workers() {
		out = append(out, m.workerStatus(dw))
	}
	return out
}

// workerStatus returns the entry of dw, one domain's worker.
func (m *monitor) workerStatus(dw privsep.DomainWorker) *admin.WorkerStatus {
	st := dw.Supervisor.State()
	w := &admin.WorkerStatus{
		Domain: dw.Domain.Name, Sources: dw.Domain.Sources, Mounts: dw.Domain.Mounts,
		Running: st.PID != 0, PID: st.PID, UID: dw.Supervisor.Identity.UID,
		Starts: st.Starts, Refusals: st.Refusals, LastEnd: st.LastEnd, Payloads: st.Payloads, Unchanged: st.Unchanged,
		LandlockABI: m.offered.LandlockABI,
		Warnings:    confinementWarnings(m.offered),
		InForce:     privsep.InForce(m.offered, dw.Policy),
	}
	if st.PID == 0 {
		return w
	}
	since := st.Since
	w.Since = &since
	o, pid, err := dw.Supervisor.ObserveWorker()
	if err != nil || pid != st.PID {
		// It ended, or another started, between the two looks.
		w.Running, w.PID, w.Since = false, 0, nil
		return w
	}
	w.Seccomp, w.NoNewPrivs = o.Seccomp == 2, o.NoNewPrivs
	w.Capabilities = o.CapEff|o.CapPrm|o.CapBnd != 0
	if slices.Contains(o.UIDs[:], 0) {
		w.Warnings = append(w.Warnings, "the worker runs with user id 0")
	}
	if w.Capabilities {
		w.Warnings = append(w.Warnings, "the worker holds capabilities")
	}
	if !w.NoNewPrivs {
		w.Warnings = append(w.Warnings, "the worker lacks no_new_privs")
	}
	return w
}
