#!/usr/bin/env bash
# The demo: local node(s) + registry, a counter snapshotted and restored. `make demo` runs it after setup.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python hack/demo_node.py "$@"
