#!/usr/bin/env bash
# Builds the Consul agent that kvmount's tests run against, from the Go
# module proxy, once, and caches it outside the repository (Consul is not
# packaged in Debian). Prints the binary's path. About 4-6 minutes cold.
set -euo pipefail

version=v1.20.1
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvmount/consul-$version"
bin="$cache/consul"
if [ -x "$bin" ]; then
	echo "$bin"
	exit 0
fi

mkdir -p "$cache"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/go.mod" <<MOD
module kvmount.invalid/consul-agent

go 1.26

require github.com/hashicorp/consul $version

// These versions of go-msgpack break Consul's build.
exclude (
	github.com/hashicorp/go-msgpack v1.1.5
	github.com/hashicorp/go-msgpack v1.1.6
)
MOD
cat >"$work/agent.go" <<'GO'
//go:build tools

package agent

import _ "github.com/hashicorp/consul"
GO
echo "building Consul $version into $bin (once; a few minutes)" >&2
(
	cd "$work"
	GOFLAGS=-mod=mod go mod tidy >&2
	go build -trimpath -o "$bin.tmp" github.com/hashicorp/consul >&2
)
mv "$bin.tmp" "$bin"
echo "$bin"
