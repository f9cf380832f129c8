#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl from the
# k8s.io/kubernetes Go module at a pinned version.
#
# Why a wrapper module: k8s.io/kubernetes' go.mod requires its staging modules at v0.0.0 and
# replaces them with ./staging/..., so `go install ...@vX` refuses it. A generated go.mod that
# replaces each staging module by its published v0.X.Y tag builds exactly upstream's sources.
#
# The binaries are cached outside the checkout, keyed by version and a hash of this script
# (the recipe), so a second run on the same machine takes seconds. Prints the bin dir on stdout.
# `build.sh --check` only looks: prints the bin dir and exits 0 if cached, else exits 1.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
CACHE_DIR="${KUBECTL_SNAPSHOT_CACHE:-/var/cache/kubectl-snapshot}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BINS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl)
TAGS="notest,grpcnotrace"
# Everything that changes the output; bump RECIPE_REV when the wrapper generation changes.
RECIPE_REV=1
GO_VERSION="$(command -v go >/dev/null && go env GOVERSION || echo none)"
RECIPE_HASH="$(printf '%s|' "$RECIPE_REV" "$K8S_VERSION" "${BINS[*]}" "$TAGS" "$GO_VERSION" | sha256sum | cut -c1-12)"
OUT="$CACHE_DIR/k8s-$K8S_VERSION-$RECIPE_HASH"

log() { printf '[cluster/build] %s\n' "$*" >&2; }

have_all() {
  local b
  for b in "${BINS[@]}"; do [ -x "$OUT/bin/$b" ] || return 1; done
}

if have_all; then
  [ "${1:-}" = --check ] || log "cached: $OUT/bin"
  echo "$OUT/bin"
  exit 0
fi
[ "${1:-}" != --check ] || exit 1

command -v go >/dev/null || { echo "error: go (>= 1.25) is needed to build Kubernetes; install it to /usr/local/go" >&2; exit 1; }
mkdir -p "$CACHE_DIR"
# One build at a time (CI and a developer may race on the same cache).
exec 9>"$CACHE_DIR/.k8s-build.lock"
flock 9
if have_all; then echo "$OUT/bin"; exit 0; fi

WRAP="$CACHE_DIR/k8s-wrapper-$K8S_VERSION"
rm -rf "$WRAP" && mkdir -p "$WRAP"
cd "$WRAP"
export GOFLAGS=-mod=mod CGO_ENABLED=0
log "generating wrapper module for k8s.io/kubernetes@$K8S_VERSION in $WRAP"
go mod init e2e.local/k8sbin >/dev/null 2>&1
UPSTREAM_MOD="$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",\?$/\1/p')"
[ -f "$UPSTREAM_MOD" ] || { echo "error: could not download k8s.io/kubernetes@$K8S_VERSION go.mod through the Go proxy" >&2; exit 1; }
STAGING_VERSION="v0.${K8S_VERSION#v1.}"
staging=$(sed -n 's#^\s*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/src/k8s\.io/.*#\1#p' "$UPSTREAM_MOD" | sort -u)
[ -n "$staging" ] || { echo "error: no staging replace directives found in $UPSTREAM_MOD" >&2; exit 1; }
args=()
for m in $staging; do args+=("-replace=$m=$m@$STAGING_VERSION"); done
go mod edit "${args[@]}"
godebug=$(sed -n 's/^godebug\s\+\(default=go[0-9.]*\)/\1/p' "$UPSTREAM_MOD" | head -1)
[ -z "$godebug" ] || go mod edit -godebug="$godebug"
goline=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$UPSTREAM_MOD" | head -1)
[ -z "$goline" ] || go mod edit -go="$goline"
go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
pkgs=()
for b in "${BINS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
log "resolving modules ($(echo "$staging" | wc -l) staging modules at $STAGING_VERSION)"
go get "${pkgs[@]/%/@$K8S_VERSION}" >/dev/null 2>&1 || go get "${pkgs[@]/%/@$K8S_VERSION}"

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  ld+=" -X $p.gitTreeState=clean -X $p.buildDate=$date"
done
log "compiling ${BINS[*]} (cold: 25-40 min on 2 cores)"
start=$(date +%s)
rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp/bin"
go build -trimpath -tags "$TAGS" -ldflags "$ld" -o "$OUT.tmp/bin/" "${pkgs[@]}"
cp go.mod go.sum "$OUT.tmp/"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
log "built in $(( $(date +%s) - start ))s: $OUT/bin"
echo "$OUT/bin"
