#!/usr/bin/env bash
# The demo (`make demo` runs it after setup): the local two-node cluster, the agent installed, a counter
# pod snapshotted on one node and restored on the other. `hack/demo.sh --node` runs the Kubernetes-free
# variant (two containerd instances and ks-agent); `hack/demo.sh --check` checks that the demo's cluster
# still works (CI runs it after `make test`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--node" ]; then
  exec .venv/bin/python hack/demo_node.py
fi
exec .venv/bin/python hack/demo_cluster.py "$@"
