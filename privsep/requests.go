package privsep

import (
	"fmt"
	"slices"

	"golang.org/x/time/rate"

	"github.com/kvmount/kvmount/config"
)

// This file is what a worker may ask of the monitor, and so everything a
// compromised worker can make root do: each message a worker may send,
// the phase of its life in which it may send it, the budget that bounds
// it and what the monitor does with it — as OpenSSH's monitor.c holds its
// dispatch tables. The wire (wire.go, messages.go) bounds every frame
// first; the Supervisor (supervise.go) refuses a message out of its
// phase; the Assembler (assemble.go) rebuilds payloads; the monitor's
// side (monitor.go) serves the rest through the table below. A message
// out of its phase or past its budget is a breach of the protocol: the
// worker is stopped, the breach logged and counted, and every mount
// keeps its content.

// Phase is where a worker is in its life, as its monitor sees it.
type Phase int

const (
	// Starting: the worker has been sent its configuration and has not
	// applied it yet — it is not confined, follows no source.
	Starting Phase = iota
	// Running: the worker applied a configuration (an Applied without
	// error): it is confined and follows its domain's sources.
	Running
)

func (p Phase) String() string {
	if p == Running {
		return "running"
	}
	return "starting"
}

// request is one kind of message a worker may send its monitor.
type request struct {
	// phase is the first phase in which a worker may send it.
	phase Phase
	// budget says what bounds it, beyond the wire's bound of its frame.
	budget string
	// serve is the monitor's side of it, nil where the Supervisor serves
	// it itself (Applied, a payload's frames): it does what the request
	// asks within its budget, and returns a breach.
	serve func(w *domainWorker, m Message) error
}

// requests are the messages a worker may send, by type; the decoder
// refuses any other (a monitor's message, an unknown type).
var requests = map[byte]request{
	typeLog: {Starting, fmt.Sprintf("relayed at most %v a second after a burst of %d; the rest dropped and counted", float64(RelayRate), RelayBurst),
		func(w *domainWorker, m Message) error { w.relay(m.(*Log)); return nil }},
	typeApplied: {Starting, "one answer to each Apply the monitor sent", nil},
	typeReread: {Starting, fmt.Sprintf("the credential files its domain's sources name alone; one request in flight per file; %v reads a second after a burst of %d, the rest answered with an error unread", float64(rereadRate), rereadBurst),
		func(w *domainWorker, m Message) error { return w.reread(m.(*Reread)) }},
	typePosted: {Starting, "one answer to each Post the monitor sent",
		func(w *domainWorker, m Message) error { return w.posted(m.(*Posted)) }},
	typeState: {Running, "a source of its domain",
		func(w *domainWorker, m Message) error { return w.report(m, m.(*State).Source, "") }},
	typeMountState: {Running, "a mount of its domain",
		func(w *domainWorker, m Message) error { return w.report(m, "", m.(*MountState).Mount) }},
	typeHeldBack: {Running, "a mount of its domain; one of the five guard rails",
		func(w *domainWorker, m Message) error { return w.report(m, "", m.(*HeldBack).Mount) }},
	typeUnchanged: {Running, "a mount of its domain; taken only at the digest the monitor gave it (OnDisk), once, and for the generation of its last MountState; its size within the mount's effective size",
		func(w *domainWorker, m Message) error { return w.unchanged(m.(*Unchanged)) }},
	typeBegin:  {Running, payloadBudget, nil},
	typeFile:   {Running, payloadBudget, nil},
	typeData:   {Running, payloadBudget, nil},
	typeCommit: {Running, payloadBudget, nil},
}

// payloadBudget is what bounds a payload's frames (Assembler).
const payloadBudget = "a mount of its domain; its files, directories and bytes within max_files, max_value_size, the mount's effective size (max_mount_size, a tmpfs's size_limit) and what max_total_size leaves, refused as soon as one passes"

// allowed returns why a worker in phase may not send m, nil when it may.
func allowed(m Message, phase Phase) error {
	req, ok := requests[m.msgType()]
	if !ok {
		return fmt.Errorf("%w: a %T is not a worker's to send", ErrRefused, m)
	}
	if phase < req.phase {
		return fmt.Errorf("%w: a %T while the worker is %v: it may send one once it is %v (its configuration applied)", ErrRefused, m, phase, req.phase)
	}
	return nil
}

// A worker's log lines are relayed at most RelayRate a second after a
// burst of RelayBurst: what passes is dropped and counted, and said in a
// line of the monitor's own before the next relayed one, so that a
// worker cannot flood the journal — whose rate limit would then drop the
// monitor's own lines.
const (
	RelayRate  = rate.Limit(50)
	RelayBurst = 500
)

// A worker's credential files are read at most rereadRate a second after
// a burst of rereadBurst: a source reads one again at a login or a
// refused token (a few a minute); beyond, the monitor answers without
// reading, so that a worker cannot keep root reading files.
const (
	rereadRate  = rate.Limit(10)
	rereadBurst = 20
)

// reread serves a Reread: the file is read, without following a symlink
// (config.ReadSecretFile), and its content sent back — if the
// configuration of the worker's domain names it, and no request for it
// is in flight; else a breach.
func (w *domainWorker) reread(m *Reread) error {
	w.mu.Lock()
	again := w.asked[m.Name]
	w.asked[m.Name] = true
	paced := !w.rereads.Allow()
	w.mu.Unlock()
	if again {
		// One request per file in flight, as OpenSSH's monitor takes
		// each request only in its turn.
		return fmt.Errorf("the worker asked for %s again before the answer to its last request was sent", m.Name)
	}
	if !slices.Contains(*w.files.Load(), m.Name) {
		return fmt.Errorf("the worker asked for %s, which the configuration of its domain does not name", m.Name)
	}
	answer := &Credential{Name: m.Name}
	if paced {
		answer.Err = fmt.Sprintf("%s: asked for more often than %v times a second; not read", m.Name, float64(rereadRate))
	} else if s, err := config.ReadSecretFile(m.Name); err != nil {
		answer.Err = err.Error()
	} else {
		answer.Value = []byte(s.Reveal())
	}
	w.super.Send(answer)
	return nil
}

// posted serves a Posted: the answer goes to the delivery waiting for
// it. An answer to no Post in flight is a breach.
func (w *domainWorker) posted(m *Posted) error {
	w.mu.Lock()
	answer, ok := w.posts[m.Seq]
	delete(w.posts, m.Seq)
	w.mu.Unlock()
	if !ok {
		return fmt.Errorf("the worker answered webhook %d, which it was not sent", m.Seq)
	}
	if answer != nil {
		answer <- m.Err
	}
	return nil
}

// report serves a State (of source) or a MountState or HeldBack (of
// mount): it goes to the desired state, if the source or mount is of the
// worker's domain; else a breach.
func (w *domainWorker) report(m Message, source, mount string) error {
	switch {
	case source != "" && !slices.Contains(w.domain.Sources, source):
		return fmt.Errorf("the worker of domain %s reported source %q, which is not of its domain", w.domain.Name, source)
	case mount != "" && !w.super.Serves(mount):
		return fmt.Errorf("the worker of domain %s reported mount %q, which is not of its domain", w.domain.Name, mount)
	}
	w.m.remote.HandleMessage(w.domain.Name, m)
	return nil
}

// unchanged serves an Unchanged of a mount of w's domain (report's
// check), counted once the Remote takes it.
func (w *domainWorker) unchanged(m *Unchanged) error {
	if !w.super.Serves(m.Mount) {
		return fmt.Errorf("the worker of domain %s reported mount %q, which is not of its domain", w.domain.Name, m.Mount)
	}
	if w.m.remote.HandleUnchanged(w.domain.Name, m) {
		w.super.unchanged.Add(1)
	}
	return nil
}
