#!/usr/bin/env bash
# Fail if the committed containerd stubs (shim/containerd/api) differ from what hack/gen-protos.sh
# generates from shim/containerd/protos now, or charts/ from what hack/gen-chart.py writes. Run in CI; fix with hack/gen-protos.sh and commit.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$repo/hack/gen-protos.sh" "$tmp" 2>/dev/null
if ! diff -r -x __pycache__ "$tmp/shim/containerd/api" "$repo/shim/containerd/api" >"$tmp.diff" 2>&1; then
  cat "$tmp.diff" >&2
  rm -f "$tmp.diff"
  echo "error: shim/containerd/api is out of date with shim/containerd/protos" >&2
  echo "hint: run hack/gen-protos.sh and commit the result" >&2
  exit 1
fi
rm -f "$tmp.diff"
# the Helm chart is rendered from kubectl_snapshot.deploy.render() (hack/gen-chart.py)
py="$repo/.venv/bin/python"
[ -x "$py" ] || py=python3
"$py" "$repo/hack/gen-chart.py" --check
# docs/conformance.md is the conformance suite's own table (hack/gen-conformance-doc.py)
"$py" "$repo/hack/gen-conformance-doc.py" --check
echo "generated code is up to date" >&2
