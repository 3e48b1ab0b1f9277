//go:build kvmount_crashtest

package projector

import (
	"os"
	"time"
)

// In a binary built with the kvmount_crashtest tag (cmd/kvmount's crash
// test builds one; a release never is), KVMOUNT_TEST_SWITCH_PAUSE holds
// every switch for that duration between creating ..data_tmp and renaming
// it over ..data, and KVMOUNT_TEST_MANIFEST_PAUSE holds every manifest
// half written, so that a SIGKILL can be aimed at either moment.
func init() {
	if d, err := time.ParseDuration(os.Getenv("KVMOUNT_TEST_SWITCH_PAUSE")); err == nil && d > 0 {
		testHookBeforeRename = func(string) { time.Sleep(d) }
	}
	if d, err := time.ParseDuration(os.Getenv("KVMOUNT_TEST_MANIFEST_PAUSE")); err == nil && d > 0 {
		testHookManifestWrite = func() { time.Sleep(d) }
	}
}
