package daemon

import (
	"errors"
	"fmt"
	"path/filepath"

	"github.com/kvmount/kvmount/command"
	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/fsutil"
)

// Audit inspects the host for what cfg's paths trust and returns the
// warnings kvmount check prints and the daemon logs at start: a mount's
// dir or a signal entry's pid_file whose path passes through a directory
// in which someone other than root can replace the next component
// (fsutil.Exposures, the rule of sshd's StrictModes), or through a
// symlink, which kvmount refuses to follow. (state_dir is no warning but
// an error: CheckStateDir.) None of them is an error: a
// user who can plant a symlink must not be able to stop kvmount from
// starting. kvmount protects such a mount as it can — it refuses a mount
// directory that was replaced and shows a check command its candidate
// through a mount namespace the replacement cannot reach — but the mount
// stops following its source while it is replaced.
//
// Each directory the paths share is inspected once (fsutil.Auditor): with
// 1,000 mounts under one parent, walking every path on its own took
// 230–440 ms of a restart's first second.
func Audit(cfg *config.Config) []string {
	var out []string
	var auditor fsutil.Auditor
	add := func(what, path string) {
		exposed, err := auditor.Exposures(path)
		if errors.Is(err, fsutil.ErrSymlink) {
			out = append(out, fmt.Sprintf("%s: %v; kvmount will refuse it", what, err))
			return
		}
		for _, e := range exposed {
			out = append(out, fmt.Sprintf("%s %s: %v", what, path, e))
		}
	}
	for _, m := range cfg.Mounts {
		add(fmt.Sprintf("mount %s: dir", m.Name), m.Dir)
		for _, n := range m.Notify {
			if n.Kind == config.NotifySignal {
				add(fmt.Sprintf("mount %s: pid_file", m.Name), filepath.Dir(n.PIDFile))
			}
		}
	}
	return out
}

// CheckStateDir returns why kvmount would refuse cfg's state_dir
// (fsutil.CheckPrivateDir): a directory, or a parent, that someone other
// than root can write; nil when it is root's alone or does not exist yet
// below directories only root can write.
func CheckStateDir(cfg *config.Config) error {
	if err := fsutil.CheckPrivateDir(cfg.StateDir); err != nil {
		return fmt.Errorf("state_dir: %w", err)
	}
	return nil
}

// CheckView says how check commands see the version they check on this
// host, for kvmount check and the start's log; "" when no mount has a
// check_command.
func CheckView(cfg *config.Config) string {
	for _, m := range cfg.Mounts {
		if len(m.CheckCommand) == 0 {
			continue
		}
		if err := command.NamespaceViews(); err != nil {
			return fmt.Sprintf("check_command: no private mount namespace can be made here (%v): a check sees the new version only at {{dir}} and $KVMOUNT_DIR, and its mount's own path shows the live version", errors.Unwrap(err))
		}
		return "check_command: runs in a private mount namespace in which each mount's own path shows the new version, read-only; {{dir}} and $KVMOUNT_DIR are that path, and it starts in /"
	}
	return ""
}
