# kvmount — make help lists the targets.

GO      ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
LDFLAGS := -X main.version=$(VERSION)

.DEFAULT_GOAL := help
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2

.PHONY: help build test fmt vet staticcheck consul-agent demo bench clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  %-8s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

build: ## build bin/kvmount
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/kvmount ./cmd/kvmount

test: fmt vet staticcheck ## check formatting, vet, staticcheck, and run every test with the race detector (builds a Consul agent once)
	@bin=$$(scripts/consul-agent.sh) && echo "consul agent: $$bin" && \
		KVMOUNT_CONSUL=$$bin $(GO) test -race -count=1 -timeout 30m ./...

consul-agent: ## build (once) and print the Consul agent the tests run, cached outside the repository
	@scripts/consul-agent.sh

fmt: ## fail if gofmt would change a file
	@files=$$(gofmt -l .); if [ -n "$$files" ]; then echo "gofmt would change:"; echo "$$files"; exit 1; fi

vet: ## go vet
	$(GO) vet ./...

staticcheck: ## staticcheck, pinned, run through go run
	$(GO) run $(STATICCHECK) ./...

demo: ## project keys of an in-process etcd into a directory, change them, show the tree
	$(GO) run ./examples/demo

bench: ## latency and cost benchmarks (figures in BENCHMARKS.md)
	@bin=$$(scripts/consul-agent.sh) && KVMOUNT_CONSUL=$$bin $(GO) test -run '^$$' -bench . -benchmem -benchtime 1000x -count 1 ./daemon
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 200x -count 1 ./projector
	$(GO) test -run '^$$' -bench . -benchmem -benchtime 2000x -count 1 ./source/http

clean: ## remove build output
	rm -rf bin dist
