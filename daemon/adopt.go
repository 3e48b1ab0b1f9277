package daemon

import (
	"fmt"

	"github.com/kvmount/kvmount/config"
	"github.com/kvmount/kvmount/reconcile"
)

// AdoptStopped does what kvmount adopt asks of a running daemon
// (reconcile.Reconciler.Adopt) while none runs: it forgets what the state
// directory records of mount's directory, so that the next start takes the
// directory its path reaches for the mount's own, as at a first start. It
// holds the state directory's lock meanwhile: with a daemon running it
// returns an error wrapping ErrLocked. A mount the configuration does not
// name is an error wrapping reconcile.ErrNotConfigured.
func AdoptStopped(opts Options, mount string) error {
	cfg, err := config.Load(opts.ConfigPath, opts.Registry.Decoders())
	if err != nil {
		return err
	}
	known := false
	for _, m := range cfg.Mounts {
		known = known || m.Name == mount
	}
	if !known {
		return fmt.Errorf("mount %q: %w %s", mount, reconcile.ErrNotConfigured, opts.ConfigPath)
	}
	lock, err := lockStateDir(cfg.StateDir)
	if err != nil {
		return err
	}
	defer lock.release()
	owned, err := reconcile.LoadOwned(cfg.StateDir)
	if err != nil {
		return err
	}
	defer owned.Close()
	if err := owned.RemoveManifestDir(mount); err != nil {
		return err
	}
	return owned.Delete(mount)
}
