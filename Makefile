# kvmount — make help lists the targets.

GO      ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
LDFLAGS := -X main.version=$(VERSION)

.DEFAULT_GOAL := help
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
NFPM        := github.com/goreleaser/nfpm/v2/cmd/nfpm@v2.45.0
MD2MAN      := github.com/cpuguy83/go-md2man/v2@v2.0.7
# The package version: the latest v* tag without its v, else 0.0.0~git<commit>
# (a version that sorts before any release, in deb and rpm alike).
PKG_VERSION ?= $(shell v=$$(git describe --tags --match 'v[0-9]*' 2>/dev/null) && echo $${v\#v} || echo 0.0.0~git$$(git rev-parse --short HEAD))
PKG_ARCHS   ?= amd64 arm64
# How kvmount is built for the packages, and so for make build and the
# baseline make bench-baseline compares with: static, no cgo (the
# benchmarks build this tree alike, daemon/bench_test.go's buildKvmount).
STATIC_BUILD = CGO_ENABLED=0 $(GO) build -trimpath

.PHONY: help build test fmt vet staticcheck outputs consul-agent vault-server demo bench bench-baseline bench-fleet package clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## build bin/kvmount, static as the packages ship it
	$(STATIC_BUILD) -ldflags '$(LDFLAGS)' -o bin/kvmount ./cmd/kvmount

test: fmt vet staticcheck outputs ## check formatting, vet, staticcheck, that no build output is committed, and run every test with the race detector (builds a Consul agent, an etcd server, consul-template and a Vault server once)
	@bin=$$(scripts/consul-agent.sh) && echo "consul agent: $$bin" && \
		etcd=$$(scripts/etcd-server.sh) && echo "etcd server: $$etcd" && \
		ct=$$(scripts/consul-template.sh) && echo "consul-template: $$ct" && \
		vault=$$(scripts/vault-server.sh) && echo "vault server: $$vault" && \
		KVMOUNT_VERIFY_PLAN=1 KVMOUNT_CONSUL=$$bin KVMOUNT_ETCD=$$etcd KVMOUNT_CONSUL_TEMPLATE=$$ct KVMOUNT_VAULT=$$vault $(GO) test -race -count=1 -timeout 30m ./...

consul-agent: ## build (once) and print the Consul agent the tests run, cached outside the repository
	@scripts/consul-agent.sh

vault-server: ## build (once) and print the Vault server the tests run (a test server only: Vault is BUSL-1.1), cached outside the repository
	@scripts/vault-server.sh

fmt: ## fail if gofmt would change a file
	@files=$$(gofmt -l .); if [ -n "$$files" ]; then echo "gofmt would change:"; echo "$$files"; exit 1; fi

outputs: ## fail if a build output (an ELF executable) is tracked by git
	@git rev-parse --git-dir >/dev/null 2>&1 || exit 0; \
		bad=$$(git ls-files -z | xargs -0 -r sh -c 'for f; do [ -f "$$f" ] && [ "$$(head -c 4 "$$f" | od -An -c | tr -d " \n")" = "177ELF" ] && echo "$$f"; done; true' sh); \
		if [ -n "$$bad" ]; then echo "build outputs are tracked (git rm --cached them):"; echo "$$bad"; exit 1; fi

vet: ## go vet
	$(GO) vet ./...

staticcheck: ## staticcheck, pinned, run through go run
	$(GO) run $(STATICCHECK) ./...

demo: ## project keys of an in-process etcd into a directory, change them, show the tree
	$(GO) run ./examples/demo

bench: ## latency and cost benchmarks (figures in BENCHMARKS.md)
	@bin=$$(scripts/consul-agent.sh) && KVMOUNT_CONSUL=$$bin $(GO) test -run '^$$' -bench . -skip '^(BenchmarkFleet|BenchmarkReplacedGrace|BenchmarkVault.*|BenchmarkWorkersPerDomain)$$' -benchmem -benchtime 1000x -count 1 ./daemon
	$(GO) test -run '^$$' -bench '^BenchmarkReplacedGrace$$' -benchtime 5x -count 1 ./daemon
	$(GO) test -run '^$$' -bench '^BenchmarkWorkersPerDomain$$' -benchtime 3x -count 2 -timeout 20m ./daemon
	@vault=$$(scripts/vault-server.sh) && ct=$$(scripts/consul-template.sh) && KVMOUNT_VAULT=$$vault KVMOUNT_CONSUL_TEMPLATE=$$ct $(GO) test -run '^$$' -bench '^BenchmarkVault' -benchtime 20x -count 1 -timeout 20m ./daemon
	@vault=$$(scripts/vault-server.sh) && bin=$$(scripts/consul-agent.sh) && KVMOUNT_VAULT=$$vault KVMOUNT_CONSUL=$$bin $(GO) test -run '^$$' -bench '^Benchmark(VaultRequests|ConsulProbe|ConsulModes)$$' -benchtime 1x -count 1 -timeout 30m ./topology
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 200x -count 1 ./projector
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 2000x -count 1 ./source/http
	$(GO) test -run '^$$' -bench . -benchmem -count 1 ./reconcile ./admin ./source/consul
	@etcd=$$(scripts/etcd-server.sh) && KVMOUNT_ETCD=$$etcd $(GO) test -run '^$$' -bench '^BenchmarkWatchGrouping$$' -benchtime 1x -count 3 -timeout 20m ./source/etcd
	$(GO) test -run '^$$' -bench '^BenchmarkWakeUp$$' -benchtime 2000x -count 3 ./privsep
	$(GO) test -run '^$$' -bench '^BenchmarkRemoteResend$$' -benchtime 3x -count 3 ./privsep
	$(GO) test -run '^$$' -bench '^BenchmarkDomainConfiguration1000Mounts$$' -benchmem -count 3 ./privsep
	$(MAKE) bench-baseline

# The commit bench-baseline compares this tree with: by default the last one
# before the privilege separation (issue 28), whose daemon was one process.
BASE ?= a21dae7
bench-baseline: ## put → file (alone, and beside 999 mounts), and start, restart and memory with 1,000 mounts: this tree beside BASE's binary (default a21dae7), side by side in one run
	@tmp=$$(mktemp -d) && git worktree add -q --detach $$tmp/src $(BASE) && \
	(cd $$tmp/src && $(STATIC_BUILD) -o $$tmp/kvmount-base ./cmd/kvmount); rc=$$?; git worktree remove --force $$tmp/src; \
	if [ $$rc = 0 ]; then \
		bin=$$(scripts/consul-agent.sh) && \
		KVMOUNT_BENCH_BASELINE=$$tmp/kvmount-base KVMOUNT_CONSUL=$$bin $(GO) test -run '^$$' -bench '^BenchmarkPutToFile$$' -benchtime 1000x -count 3 ./daemon && \
		KVMOUNT_BENCH_BASELINE=$$tmp/kvmount-base $(GO) test -run '^$$' -bench '^BenchmarkPutToFileBeside999Mounts$$' -benchtime 1000x -count 3 ./daemon && \
		KVMOUNT_BENCH_BASELINE=$$tmp/kvmount-base $(GO) test -run '^$$' -bench '^BenchmarkScale100kKeys$$' -benchtime 1x -count 2 -timeout 60m ./daemon; rc=$$?; \
	fi; rm -rf $$tmp; exit $$rc

# FLEET daemons (separate process trees) against one etcd, a 3-member etcd
# cluster directly and through etcd's gRPC proxy, then one Consul agent.
FLEET ?= 100
bench-fleet: ## fan-out of one write to FLEET kvmount daemons (default 100), idle cost of the store, every daemon restarted at once (figures in BENCHMARKS.md)
	@bin=$$(scripts/consul-agent.sh) && etcd=$$(scripts/etcd-server.sh) && KVMOUNT_CONSUL=$$bin KVMOUNT_ETCD=$$etcd KVMOUNT_FLEET=$(FLEET) $(GO) test -run '^$$' -bench '^BenchmarkFleet$$' -benchtime 20x -count 1 -timeout 60m ./daemon

package: ## build the .deb and .rpm packages (amd64, arm64) into dist/ with nfpm (pinned, run through go run)
	rm -rf dist && mkdir -p dist/pkg
	$(GO) run $(MD2MAN) -in packaging/kvmount.8.md -out dist/pkg/kvmount.8
	gzip -9nf dist/pkg/kvmount.8
	for arch in $(PKG_ARCHS); do \
		GOOS=linux GOARCH=$$arch $(STATIC_BUILD) -ldflags '-X main.version=$(PKG_VERSION)' -o dist/pkg/kvmount ./cmd/kvmount || exit 1; \
		for format in deb rpm; do \
			ARCH=$$arch VERSION=$(PKG_VERSION) $(GO) run $(NFPM) package -f packaging/nfpm.yaml -p $$format -t dist/ || exit 1; \
		done; \
	done
	rm -rf dist/pkg
	@ls -1 dist/*.deb dist/*.rpm

clean: ## remove build output
	rm -rf bin dist
