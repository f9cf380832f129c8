#!/usr/bin/env bash
# Build the node agent's image offline (Debian packages + PyPI wheels, no Docker engine, no base
# image from a registry), push it and print REF@sha256:DIGEST. Rebuilds only when the project's
# sources or the recipe changed (cache: /var/cache/kubectl-snapshot/agent-image/).
# Usage (root): hack/build-agent-image.sh 127.0.0.1:5005/kubectl-snapshot/agent:dev [--no-push]
# Details: hack/agent_image.py. With normal tools, Containerfile is the same recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 IMAGE_REF [--no-push]" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "error: needs root (debootstrap)" >&2; echo "hint: sudo $0 $*" >&2; exit 1; }
[ -x .venv/bin/python ] || { echo "error: .venv is missing" >&2; echo "hint: hack/setup-venv.sh" >&2; exit 1; }
exec .venv/bin/python hack/agent_image.py "$@"
