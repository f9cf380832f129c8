#!/usr/bin/env bash
# Build the real cosign CLI from the Go module proxy, cached outside the checkout by version, so that
# the tests can check that `cosign verify --key` accepts the agent's signatures (interoperability, not
# a runtime dependency: the agent and the plugin never run cosign). Prints the binary's path.
# Offline use only: the tests run it with --insecure-ignore-tlog/--insecure-ignore-sct against the
# loopback registry.
set -euo pipefail

COSIGN_VERSION="${COSIGN_VERSION:-v2.6.5}"
CACHE_DIR="${KUBECTL_SNAPSHOT_CACHE:-/var/cache/kubectl-snapshot}"
dir="$CACHE_DIR/cosign/$COSIGN_VERSION"
export PATH="/usr/local/go/bin:$PATH"

if [ ! -x "$dir/cosign" ]; then
  command -v go >/dev/null || { echo "error: go is needed to build cosign" >&2; exit 1; }
  echo "[install-cosign] building cosign $COSIGN_VERSION from the Go module proxy (cached in $dir)" >&2
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp"
  GOBIN="$dir.tmp" CGO_ENABLED=0 GOFLAGS=-mod=mod go install -ldflags "-s -w" \
    "github.com/sigstore/cosign/v2/cmd/cosign@$COSIGN_VERSION"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
echo "$dir/cosign"
