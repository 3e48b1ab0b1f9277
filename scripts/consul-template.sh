#!/usr/bin/env bash
# Builds consul-template, which the template parity test renders beside
# kvmount render, from the Go module proxy, once, and caches it outside the
# repository. Prints the binary's path. A few minutes cold.
set -euo pipefail

version=v0.42.1
cache="${XDG_CACHE_HOME:-$HOME/.cache}/kvmount/consul-template-$version"
bin="$cache/consul-template"
if [ -x "$bin" ]; then
	echo "$bin"
	exit 0
fi

mkdir -p "$cache"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/go.mod" <<MOD
module kvmount.invalid/consul-template

go 1.26

require github.com/hashicorp/consul-template $version
MOD
cat >"$work/tools.go" <<'GO'
//go:build tools

package tools

import _ "github.com/hashicorp/consul-template"
GO
echo "building consul-template $version into $bin (once; a few minutes)" >&2
(
	cd "$work"
	GOFLAGS=-mod=mod go mod tidy >&2
	go build -trimpath -o "$bin.tmp" github.com/hashicorp/consul-template >&2
)
mv "$bin.tmp" "$bin"
echo "$bin"
