#!/usr/bin/env bash
# Build a Go CLI the tests use (krew, its manifest validator, helm) from the Go module proxy, cached
# outside the checkout by tool and version: /var/cache/kubectl-snapshot/<tool>/<version>/<binary>.
#
#   hack/build-go-tool.sh krew     -> .../krew/v0.4.3/{krew,validate-krew-manifest}
#   hack/build-go-tool.sh helm     -> .../helm/v3.22.0/helm
#   hack/build-go-tool.sh checkpointctl -> .../checkpointctl/v1.4.0/checkpointctl (reads podman/CRI-O archives)
#   hack/build-go-tool.sh --check krew   prints the directory and exits 0 when cached, else exits 1
#
# Prints the directory holding the binaries on stdout (logs go to stderr).
set -euo pipefail
CACHE_DIR="${KUBECTL_SNAPSHOT_CACHE:-/var/cache/kubectl-snapshot}"
KREW_VERSION="${KREW_VERSION:-v0.4.3}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
CHECKPOINTCTL_VERSION="${CHECKPOINTCTL_VERSION:-v1.4.0}"
check=0
if [ "${1:-}" = --check ]; then check=1; shift; fi
tool="${1:?usage: build-go-tool.sh [--check] krew|helm|checkpointctl}"
case "$tool" in
  krew) version="$KREW_VERSION"; pkgs=("sigs.k8s.io/krew/cmd/krew" "sigs.k8s.io/krew/cmd/validate-krew-manifest")
        bins=(krew validate-krew-manifest) ;;
  helm) version="$HELM_VERSION"; pkgs=("helm.sh/helm/v3/cmd/helm"); bins=(helm) ;;
  checkpointctl) version="$CHECKPOINTCTL_VERSION"; pkgs=("github.com/checkpoint-restore/checkpointctl")
        bins=(checkpointctl) ;;
  *) echo "unknown tool $tool (krew, helm, checkpointctl)" >&2; exit 2 ;;
esac
dir="$CACHE_DIR/$tool/$version"
cached() { for b in "${bins[@]}"; do [ -x "$dir/$b" ] || return 1; done; }
if cached; then echo "$dir"; exit 0; fi
[ "$check" = 1 ] && exit 1
for d in /usr/local/go/bin; do [ -d "$d" ] && PATH="$d:$PATH"; done
command -v go >/dev/null || { echo "go is not installed (hack/install-node-deps.sh installs it)" >&2; exit 1; }
mkdir -p "$CACHE_DIR/$tool"
exec 9>"$CACHE_DIR/$tool/.lock"
flock 9
if cached; then echo "$dir"; exit 0; fi
rm -rf "$dir.tmp"
mkdir -p "$dir.tmp"
echo "building $tool $version from the Go module proxy (cached in $dir)" >&2
for p in "${pkgs[@]}"; do
  GOBIN="$dir.tmp" CGO_ENABLED=0 GOFLAGS=-mod=mod go install -trimpath "$p@$version" >&2
done
rm -rf "$dir"
mv "$dir.tmp" "$dir"
echo "$dir"
