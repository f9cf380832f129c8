# kubectl-snapshot developer entry points. Everything runs as root on a Debian 12 node.
#   make demo   set up a local node + registry, snapshot a counter container and restore it
#   make check  the fast lane before the full suite: lint, types, import contracts, generated code, unit tests
#   make test   set up what the tests need, run lint, types, generated-code check and all tests
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup podman deps cluster-deps go-tools cosign venv lint typecheck check-generated protos chart unit check integration e2e test demo demo-node bench bench-autosave clean

deps:
	hack/install-node-deps.sh

# etcd, CNI plugins and the Kubernetes binaries built from source (cached by version; ~30 min cold)
cluster-deps: deps
	hack/cluster/install-deps.sh
	hack/cluster/build.sh

# the real cosign CLI, built from the Go module proxy and cached by version: the tests check that
# `cosign verify --key` accepts the agents' snapshot signatures (~3 min cold)
cosign:
	hack/install-cosign.sh >/dev/null

venv:
	hack/setup-venv.sh

# krew (and its manifest validator), helm and checkpointctl, built from the Go module proxy, cached by version
go-tools: deps
	hack/build-go-tool.sh krew
	hack/build-go-tool.sh helm
	hack/build-go-tool.sh checkpointctl

setup: deps venv

# podman (Debian's 5.4): the peer bench/ compares against, and what restores an export in the tests
podman: deps
	hack/install-bench-deps.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) hack/check-house.py
	hack/check-go.sh

typecheck: venv
	$(VENV)/bin/mypy

protos: venv
	hack/gen-protos.sh

check-generated: venv
	hack/check-generated.sh

chart: venv
	$(PY) hack/gen-chart.py

unit: venv
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

# The fast lane a developer runs before the full suite (a few minutes; no cluster, no containerd):
# lint (with the Go launcher's gofmt/vet/test), import contracts, types, generated code, unit tests
# (which also compare manifests/ with hack/gen-manifests.py).
check: lint typecheck check-generated
	$(VENV)/bin/pytest tests/unit -q -p no:cacheprovider $(PYTEST_ARGS)

integration: setup cosign podman
	$(VENV)/bin/pytest tests/integration $(PYTEST_ARGS)

# then the cluster smoke on every other supported containerd release (hack/smoke-containerd.sh; skipped
# while a cluster is up, e.g. `make demo`'s, which it would have to take down)
test: setup cluster-deps go-tools cosign podman lint typecheck check-generated
	$(VENV)/bin/pytest tests $(PYTEST_ARGS)
	hack/smoke-containerd.sh

demo: setup cluster-deps
	hack/demo.sh

demo-node: setup
	hack/demo.sh --node

bench: setup
	hack/install-bench-deps.sh
	$(PY) bench/run.py --quick

# autosave's steady cost (issue 12): a 2 GiB process, 1% changed per save, and a 64 MiB pod (~3 min);
# BENCH_ARGS="--size 256" for a quick run. It writes /etc/criu/runc.conf: hold the e2e lock on shared machines
bench-autosave: venv
	flock /run/ks-e2e.lock $(PY) -m bench.autosave_cost $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
