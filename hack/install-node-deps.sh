#!/usr/bin/env bash
# Install what a kubectl-snapshot node (and its tests) needs, idempotently:
#   - CRIU 4.2.1 + python3-pycriu from Debian sid, runc 1.1.15 and docker-registry from trixie
#     (pinned low so nothing else moves; see shared PLATFORM.md for why not bookworm/trixie CRIU);
#   - containerd v2.3.x built from the Go module proxy by hack/build-containerd.sh (restore-via-create
#     is off by default from 2.3.4 and the project never enables it), cached outside the checkout by
#     version; the other supported releases the tests run are built the same way, on demand;
#   - small tools the tests use (busybox-static, zstd, iproute2, ...).
# Ends with `criu check`.
set -euo pipefail

CONTAINERD_VERSION="${CONTAINERD_VERSION:-v2.3.7}"
export DEBIAN_FRONTEND=noninteractive

log() { printf '[install-node-deps] %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
  echo "error: must run as root (installs packages and binaries)" >&2
  exit 1
fi

# --- apt sources: trixie and sid, pinned low -------------------------------------------------
add_sources() {
  local f=/etc/apt/sources.list.d/kubectl-snapshot-testing.sources
  if [ ! -f "$f" ]; then
    cat >"$f" <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  cat >/etc/apt/preferences.d/kubectl-snapshot-pins <<'PIN'
Package: *
Pin: release n=trixie
Pin-Priority: 100

Package: *
Pin: release n=sid
Pin-Priority: 50
PIN
}

# Keep package maintainer scripts from starting services (no init system here).
no_services() {
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
}

have_version() { # pkg version-prefix
  dpkg-query -W -f='${Status} ${Version}\n' "$1" 2>/dev/null | grep -q "install ok installed $2"
}

install_apt() {
  add_sources
  no_services
  local base_pkgs=(busybox-static zstd iproute2 iptables openssl curl ca-certificates jq
                   debootstrap apache2-utils psmisc procps kmod)
  local missing=()
  for p in "${base_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if ! have_version criu 4.2 || ! have_version python3-pycriu 4.2 || ! dpkg -s runc >/dev/null 2>&1 \
     || ! dpkg -s docker-registry >/dev/null 2>&1 || [ ${#missing[@]} -gt 0 ]; then
    log "apt-get update"
    apt-get update -qq
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if ! have_version criu 4.2; then
    # trixie first (brings libc6 2.41 and CRIU's libraries), then sid's 4.2.1 on top.
    log "installing criu (trixie, then sid 4.2.1)"
    apt-get install -y -qq --no-install-recommends -t trixie criu >/dev/null
    apt-get install -y -qq --no-install-recommends -t sid criu python3-pycriu >/dev/null
  fi
  if ! have_version python3-pycriu 4.2; then
    apt-get install -y -qq --no-install-recommends -t sid python3-pycriu >/dev/null
  fi
  if ! dpkg -s runc >/dev/null 2>&1 || ! dpkg -s docker-registry >/dev/null 2>&1; then
    log "installing runc, docker-registry (trixie)"
    apt-get install -y -qq --no-install-recommends -t trixie runc docker-registry >/dev/null
  fi
}

install_containerd() {
  local dir
  dir="$("$(dirname "${BASH_SOURCE[0]}")/build-containerd.sh" "$CONTAINERD_VERSION")"
  for b in containerd containerd-shim-runc-v2 ctr; do
    if ! cmp -s "$dir/$b" "/usr/local/bin/$b"; then
      install -m 0755 "$dir/$b" "/usr/local/bin/$b"
    fi
  done
}

install_apt
install_containerd

log "versions: $(criu --version | head -1 | tr -s ' '); runc $(runc --version | head -1 | awk '{print $3}'); $(containerd --version | awk '{print $1, $3}')"
criu check
