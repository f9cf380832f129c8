#!/usr/bin/env bash
# Benchmark dependencies: Podman 5.4 from Debian trixie, the peer that bench/ compares against, and
# what restores an export in tests/integration/test_export_podman.py (`make test` installs it). Run
# after hack/install-node-deps.sh, which adds the trixie/sid apt sources pinned low (trixie 100,
# sid 50) so that nothing else moves by itself.
# Podman must run with `--runtime runc` here: crun refuses cgroup v1 hybrid mode (PLATFORM.md).
set -euo pipefail

log() { echo "[install-bench-deps] $*" >&2; }

if [[ $EUID -ne 0 ]]; then
  echo "run as root" >&2
  exit 1
fi
if [[ ! -f /etc/apt/sources.list.d/kubectl-snapshot-testing.sources ]]; then
  echo "run hack/install-node-deps.sh first (it adds the pinned trixie/sid sources)" >&2
  exit 1
fi

if command -v podman >/dev/null && podman --version | grep -q ' 5\.'; then
  log "podman present: $(podman --version)"
else
  log "apt-get update"
  apt-get update -qq
  log "installing podman (trixie)"
  # zstd: the raw-CRIU bound compresses with the zstd CLI; crun is pulled as a dependency but unused.
  apt-get install -y -qq --no-install-recommends -t trixie podman conmon \
    netavark catatonit zstd >/dev/null
fi
# Podman's defaults for a root user on this VM: runc (crun refuses cgroup v1 hybrid), cgroupfs (no
# systemd as PID 1), file events (no journald).
install -d /etc/containers/containers.conf.d
cat >/etc/containers/containers.conf.d/50-kubectl-snapshot-bench.conf <<'CONF'
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
log "podman: $(podman --version)"
