#!/usr/bin/env bash
# Builds the etcd server that kvmount's multi-member cluster tests run as
# separate processes (so that a test can freeze one with SIGSTOP), from the
# Go module proxy, once, at the version of the etcd modules in go.mod, and
# caches it outside the repository. Prints the binary's path. About a
# minute cold. (The other tests run etcd in-process.)
set -euo pipefail

cd "$(dirname "$0")/.."
version=$(go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvmount/etcd-$version"
bin="$cache/etcd"
if [ -x "$bin" ]; then
	echo "$bin"
	exit 0
fi

mkdir -p "$cache"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/go.mod" <<MOD
module kvmount.invalid/etcd-server

go 1.26

require go.etcd.io/etcd/server/v3 $version
MOD
cat >"$work/server.go" <<'GO'
//go:build tools

package server

import _ "go.etcd.io/etcd/server/v3"
GO
echo "building etcd $version into $bin (once; about a minute)" >&2
(
	cd "$work"
	GOFLAGS=-mod=mod go mod tidy >&2
	go build -trimpath -o "$bin.tmp" go.etcd.io/etcd/server/v3 >&2
)
mv "$bin.tmp" "$bin"
echo "$bin"
