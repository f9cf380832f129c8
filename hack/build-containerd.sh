#!/usr/bin/env bash
# Build containerd, ctr and containerd-shim-runc-v2 of one release from the Go module proxy, cached
# outside the checkout by version: /var/cache/kubectl-snapshot/containerd-<version>/.
#
#   hack/build-containerd.sh v2.3.7           -> .../containerd-v2.3.7/{containerd,ctr,containerd-shim-runc-v2}
#   hack/build-containerd.sh v1.7.35          (module github.com/containerd/containerd, no /v2)
#   hack/build-containerd.sh --check v2.2.9   prints the directory and exits 0 when cached, else exits 1
#
# Prints the directory holding the binaries on stdout (logs go to stderr).
#
# Built inside the module's own directory in the module cache (`go mod download -json` names it)
# rather than with `go install MODULE@VERSION`: containerd 1.7's go.mod has an exclude directive,
# which `go install pkg@version` refuses. The module's go.mod and go.sum then decide every
# dependency, as in containerd's own release build.
set -euo pipefail
CACHE_DIR="${KUBECTL_SNAPSHOT_CACHE:-/var/cache/kubectl-snapshot}"
check=0
if [ "${1:-}" = --check ]; then check=1; shift; fi
version="${1:?usage: build-containerd.sh [--check] VERSION (e.g. v2.3.7, v1.7.35)}"
case "$version" in
  v1.*) module=github.com/containerd/containerd ;;
  v2.*) module=github.com/containerd/containerd/v2 ;;
  *) echo "error: unsupported containerd version $version" >&2
     echo "hint: give a release tag such as v2.3.7 or v1.7.35" >&2; exit 2 ;;
esac
bins=(containerd ctr containerd-shim-runc-v2)
dir="$CACHE_DIR/containerd-$version"
cached() { for b in "${bins[@]}"; do [ -x "$dir/$b" ] || return 1; done; }
if cached; then echo "$dir"; exit 0; fi
[ "$check" = 1 ] && exit 1
for d in /usr/local/go/bin; do [ -d "$d" ] && PATH="$d:$PATH"; done
command -v go >/dev/null || { echo "error: go is needed to build containerd" >&2; exit 1; }
mkdir -p "$CACHE_DIR"
exec 9>"$CACHE_DIR/.containerd-build.lock"
flock 9
if cached; then echo "$dir"; exit 0; fi
echo "building containerd $version from the Go module proxy (cached in $dir)" >&2
src="$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[ -d "$src" ] || { echo "error: go mod download gave no directory for $module@$version" >&2; exit 1; }
rm -rf "$dir.tmp"
mkdir -p "$dir.tmp"
ld="-s -w -X $module/version.Version=$version"
# GOFLAGS=-mod=readonly: the module cache is read-only and its go.sum is complete.
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
(cd "$src" && go build -trimpath -tags "no_btrfs no_devmapper no_zfs urfave_cli_no_docs" -ldflags "$ld" \
   -o "$dir.tmp/" ./cmd/containerd ./cmd/ctr >&2)
(cd "$src" && go build -trimpath -tags "no_grpc" -ldflags "$ld" -o "$dir.tmp/" ./cmd/containerd-shim-runc-v2 >&2)
rm -rf "$dir"
mv "$dir.tmp" "$dir"
echo "$dir"
