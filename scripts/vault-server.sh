#!/usr/bin/env bash
# Builds the Vault server that kvmount's tests run against (vault server
# -dev, in memory), from the Go module proxy, once, and caches it outside
# the repository. Prints the binary's path. About 6 minutes cold.
#
# The build module is scripts/vault-server/: Vault v1.16.3 with the sdk
# v0.12.0 (one minor above the version Vault's go.mod names, whose own tree
# had moved ahead) and the api v1.12.0, and the one non-local replace of
# Vault's go.mod. Its go.sum is checked in: the checksum database cannot be
# asked about some of Vault's plugin modules here, so the build verifies
# every module against that file instead (GOSUMDB=off). Vault 1.16 is
# BUSL-1.1: it is a test server only; kvmount links only the MPL-2.0 api
# module.
set -euo pipefail

version=v1.16.3
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvmount/vault-$version"
bin="$cache/vault"
if [ -x "$bin" ]; then
	echo "$bin"
	exit 0
fi

src="$(cd "$(dirname "$0")" && pwd)/vault-server"
mkdir -p "$cache"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$src/go.mod" "$src/go.sum" "$src/server.go" "$work/"
echo "building Vault $version into $bin (once; about 6 minutes)" >&2
(
	cd "$work"
	GOFLAGS=-mod=mod GOSUMDB=off go build -trimpath -o "$bin.tmp" github.com/hashicorp/vault >&2
)
mv "$bin.tmp" "$bin"
echo "$bin"
