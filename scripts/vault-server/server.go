//go:build tools

// Package server is the build module of the Vault server kvmount's tests
// run against (scripts/vault-server.sh): Vault v1.16.3 (BUSL-1.1), a test
// server only — kvmount links the MPL-2.0 api module alone.
package server

import _ "github.com/hashicorp/vault"
