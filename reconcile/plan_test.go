package reconcile

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/projector"
)

func TestPlan(t *testing.T) {
	now := time.Date(2026, 11, 22, 1, 0, 0, 0, time.UTC)
	spec := func(dir string) *config.Mount { return &config.Mount{Dir: dir, Medium: config.MediumDisk} }
	ready := func(dir string, gen uint64) *DesiredMount {
		return &DesiredMount{Spec: spec(dir), Payload: projector.Payload{}, Generation: gen}
	}
	waiting := func(dir string, gen uint64) *DesiredMount {
		return &DesiredMount{Spec: spec(dir), Generation: gen, Waiting: []string{"main"}}
	}
	failed := func(dir string, gen uint64) *DesiredMount {
		return &DesiredMount{Spec: spec(dir), Generation: gen, Err: errors.New("prefix does not exist")}
	}
	actual := func(dir string, gen uint64) *ActualMount {
		return &ActualMount{Dir: dir, Medium: config.MediumDisk, Generation: gen}
	}
	tests := []struct {
		name      string
		dsw       DesiredState
		mounts    map[string]*ActualMount
		failures  map[string]*Failure
		heldBack  map[string]*HeldBack
		inFlight  map[string]bool
		want      string
		wantRetry time.Time
	}{
		{name: "nothing", want: "[]"},
		{name: "new ready mount is set up", dsw: DesiredState{"a": ready("/a", 1)}, want: "[setup a]"},
		{name: "new mount waiting for its source", dsw: DesiredState{"a": waiting("/a", 0)}, want: "[]"},
		{name: "new mount whose payload failed", dsw: DesiredState{"a": failed("/a", 1)}, want: "[]"},
		{name: "projected and current", dsw: DesiredState{"a": ready("/a", 3)}, mounts: map[string]*ActualMount{"a": actual("/a", 3)}, want: "[]"},
		{name: "new generation is remounted", dsw: DesiredState{"a": ready("/a", 4)}, mounts: map[string]*ActualMount{"a": actual("/a", 3)}, want: "[remount a]"},
		{name: "adopted mount is remounted", dsw: DesiredState{"a": ready("/a", 1)}, mounts: map[string]*ActualMount{"a": actual("/a", 0)}, want: "[remount a]"},
		{name: "drift is remounted", dsw: DesiredState{"a": ready("/a", 3)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, RemountRequired: true}}, want: "[remount a]"},
		{name: "failed payload keeps content", dsw: DesiredState{"a": failed("/a", 4)}, mounts: map[string]*ActualMount{"a": actual("/a", 3)}, want: "[]"},
		{name: "source down keeps content", dsw: DesiredState{"a": waiting("/a", 4)}, mounts: map[string]*ActualMount{"a": actual("/a", 0)}, want: "[]"},
		{name: "undesired mount is torn down", mounts: map[string]*ActualMount{"old": actual("/old", 2)}, want: "[teardown old]"},
		{name: "moved mount is torn down first", dsw: DesiredState{"a": ready("/new", 2)}, mounts: map[string]*ActualMount{"a": actual("/old", 2)}, want: "[teardown a]"},
		{name: "moved mount waiting is torn down too", dsw: DesiredState{"a": waiting("/new", 2)}, mounts: map[string]*ActualMount{"a": actual("/old", 2)}, want: "[teardown a]"},
		{name: "verify when due", dsw: DesiredState{"a": ready("/a", 3)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, VerifyDue: true}}, want: "[verify a]"},
		{name: "verify a mount whose source is down", dsw: DesiredState{"a": waiting("/a", 3)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, VerifyDue: true}}, want: "[verify a]"},
		{name: "remount wins over verify", dsw: DesiredState{"a": ready("/a", 4)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, VerifyDue: true}}, want: "[remount a]"},
		{name: "in flight is skipped", dsw: DesiredState{"a": ready("/a", 1), "b": ready("/b", 1)}, inFlight: map[string]bool{"a": true}, want: "[setup b]"},
		{name: "backoff holds a failed mount, not the others", dsw: DesiredState{"a": ready("/a", 1), "b": ready("/b", 1)},
			failures: map[string]*Failure{"a": {Count: 1, NextRetry: now.Add(time.Second), Generation: 1}},
			want:     "[setup b]", wantRetry: now.Add(time.Second)},
		{name: "backoff over", dsw: DesiredState{"a": ready("/a", 1)},
			failures: map[string]*Failure{"a": {Count: 3, NextRetry: now, Generation: 1}}, want: "[setup a]"},
		{name: "a payload's failure: a new generation skips backoff", dsw: DesiredState{"a": ready("/a", 2)},
			failures: map[string]*Failure{"a": {Count: 5, NextRetry: now.Add(time.Minute), Generation: 1, PayloadCaused: true}}, want: "[setup a]"},
		{name: "the host's failure: a new generation waits for the backoff", dsw: DesiredState{"a": ready("/a", 2)},
			failures: map[string]*Failure{"a": {Count: 5, NextRetry: now.Add(time.Minute), Generation: 1}}, want: "[]", wantRetry: now.Add(time.Minute)},
		{name: "the host's failure: a new remount waits too", dsw: DesiredState{"a": ready("/a", 7)}, mounts: map[string]*ActualMount{"a": actual("/a", 5)},
			failures: map[string]*Failure{"a": {Count: 2, NextRetry: now.Add(time.Second), Generation: 6}}, want: "[]", wantRetry: now.Add(time.Second)},
		{name: "failed teardown backs off", mounts: map[string]*ActualMount{"old": actual("/old", 2)},
			failures: map[string]*Failure{"old": {Count: 1, NextRetry: now.Add(2 * time.Second)}}, want: "[]", wantRetry: now.Add(2 * time.Second)},
		{name: "earliest retry", dsw: DesiredState{"a": ready("/a", 1), "b": ready("/b", 1)},
			failures: map[string]*Failure{"a": {NextRetry: now.Add(5 * time.Second), Generation: 1}, "b": {NextRetry: now.Add(time.Second), Generation: 1}},
			want:     "[]", wantRetry: now.Add(time.Second)},
		{name: "swapped dirs wait for each other's teardown", dsw: DesiredState{"a": ready("/y", 2), "b": ready("/x", 2)},
			mounts: map[string]*ActualMount{"a": actual("/x", 2), "b": actual("/y", 2)}, want: "[teardown a teardown b]"},
		{name: "set up once the other is torn down", dsw: DesiredState{"a": ready("/y", 2), "b": ready("/x", 2)},
			mounts: map[string]*ActualMount{"b": actual("/y", 2)}, want: "[teardown b]"},
		{name: "a dir inside another mount's waits", dsw: DesiredState{"a": ready("/x/inner", 1)},
			mounts: map[string]*ActualMount{"old": actual("/x", 1)}, want: "[teardown old]"},
		{name: "held-back payload is not tried again", dsw: DesiredState{"a": ready("/a", 4)},
			mounts: map[string]*ActualMount{"a": actual("/a", 3)}, heldBack: map[string]*HeldBack{"a": {Generation: 4}}, want: "[]"},
		{name: "held back, first setup", dsw: DesiredState{"a": ready("/a", 1)}, heldBack: map[string]*HeldBack{"a": {Generation: 1}}, want: "[]"},
		{name: "held back, but verify still runs", dsw: DesiredState{"a": ready("/a", 4)},
			mounts:   map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, VerifyDue: true}},
			heldBack: map[string]*HeldBack{"a": {Generation: 4}}, want: "[verify a]"},
		{name: "next generation after a hold-back is tried", dsw: DesiredState{"a": ready("/a", 5)},
			mounts: map[string]*ActualMount{"a": actual("/a", 3)}, heldBack: map[string]*HeldBack{"a": {Generation: 4}}, want: "[remount a]"},
		{name: "replaced versions due are collected", dsw: DesiredState{"a": ready("/a", 3)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, CollectAt: now}}, want: "[collect a]"},
		{name: "replaced versions not yet due: a retry time", dsw: DesiredState{"a": ready("/a", 3)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, CollectAt: now.Add(5 * time.Second)}}, want: "[]", wantRetry: now.Add(5 * time.Second)},
		{name: "remount wins over collect", dsw: DesiredState{"a": ready("/a", 4)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, CollectAt: now}}, want: "[remount a]"},
		{name: "collect while the source is down", dsw: DesiredState{"a": waiting("/a", 3)},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, CollectAt: now}}, want: "[collect a]"},
		{name: "collect while held back", dsw: DesiredState{"a": ready("/a", 4)},
			mounts:   map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, CollectAt: now}},
			heldBack: map[string]*HeldBack{"a": {Generation: 4}}, want: "[collect a]"},
		{name: "collect while waiting for quiescence", dsw: DesiredState{"a": {Spec: &config.Mount{Dir: "/a", Medium: "disk", Wait: config.Wait{Min: time.Second, Max: 4 * time.Second}},
			Payload: projector.Payload{}, Generation: 4, ChangedAt: now}},
			mounts: map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, CollectAt: now}}, want: "[collect a]", wantRetry: now.Add(time.Second)},
		{name: "collect while backing off", dsw: DesiredState{"a": ready("/a", 4)},
			mounts:   map[string]*ActualMount{"a": {Dir: "/a", Medium: "disk", Generation: 3, CollectAt: now, VerifyDue: true}},
			failures: map[string]*Failure{"a": {Count: 1, NextRetry: now.Add(time.Second), Generation: 4}}, want: "[collect a]", wantRetry: now.Add(time.Second)},
		{name: "sorted by name", dsw: DesiredState{"c": ready("/c", 1), "a": ready("/a", 1)}, mounts: map[string]*ActualMount{"b": actual("/b", 1)},
			want: "[setup a teardown b setup c]"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			asw := NewActualState()
			for k, v := range tt.mounts {
				asw.Mounts[k] = v
			}
			for k, v := range tt.failures {
				asw.Failures[k] = v
			}
			for k, v := range tt.heldBack {
				asw.HeldBack[k] = v
			}
			for k, v := range tt.inFlight {
				asw.InFlight[k] = v
			}
			ops, retry := Plan(tt.dsw, asw, now)
			if got := fmt.Sprint(ops); got != tt.want && !(len(ops) == 0 && tt.want == "[]") {
				t.Errorf("Plan = %s; want %s", got, tt.want)
			}
			if !retry.Equal(tt.wantRetry) {
				t.Errorf("retry = %v; want %v", retry, tt.wantRetry)
			}
		})
	}
}

// TestBackoffDelay: the kubelet's schedule, 500 ms doubling to 2 min 2 s
// (README "What happens when things go wrong").
func TestBackoffDelay(t *testing.T) {
	tests := []struct {
		n    int
		want time.Duration
	}{
		{1, 500 * time.Millisecond}, {2, time.Second}, {3, 2 * time.Second}, {8, 64 * time.Second},
		{9, BackoffMax}, {100, BackoffMax},
	}
	for _, tt := range tests {
		if got := BackoffDelay(tt.n); got != tt.want {
			t.Errorf("BackoffDelay(%d) = %v; want %v", tt.n, got, tt.want)
		}
	}
}

func TestTakenDirs(t *testing.T) {
	asw := NewActualState()
	for name, dir := range map[string]string{"a": "/srv/x", "b": "/srv/deep/er/y", "c": "/opt/z/"} {
		asw.Mounts[name] = &ActualMount{Dir: dir, Medium: config.MediumDisk}
	}
	taken := newTakenDirs(asw)
	for dir, want := range map[string]bool{
		"/srv/x":          true,  // held
		"/srv/x/inner":    true,  // inside one held
		"/srv/x/a/b":      true,  // deeper inside
		"/srv":            true,  // around one held
		"/":               true,  // around all
		"/srv/deep":       true,  // around one held two levels down
		"/opt/z":          true,  // held, recorded with a trailing slash
		"/opt/z/inner/":   true,  // inside it, asked with one
		"/srv/xy":         false, // a sibling that shares the prefix
		"/srv/w":          false, // a sibling
		"/srv/deep/er/yz": false,
		"/opt/zz/z":       false,
		"/var":            false,
	} {
		if got := taken.overlaps(dir); got != want {
			t.Errorf("overlaps(%q) = %v; want %v", dir, got, want)
		}
	}
	if got := newTakenDirs(NewActualState()).overlaps("/srv/x"); got {
		t.Error("with no mount projected, /srv/x is taken")
	}
}
