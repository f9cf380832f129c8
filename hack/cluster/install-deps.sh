#!/usr/bin/env bash
# Install what the local two-node cluster needs on top of the node dependencies:
#   - hack/install-node-deps.sh (CRIU 4.2.1, runc, containerd v2.3.7, docker-registry, ...);
#   - etcd 3.5.16 and the CNI plugins (into /usr/lib/cni) from Debian trixie, pinned low the
#     same way (install-node-deps.sh adds the sources and the policy-rc.d that keeps etcd's
#     postinst from starting a SysV service);
#   - the images need only busybox-static (installed by install-node-deps.sh) and Go (pause).
# Idempotent; safe to re-run.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export DEBIAN_FRONTEND=noninteractive
log() { printf '[cluster/install-deps] %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { echo "error: must run as root" >&2; exit 1; }

"$HERE/../install-node-deps.sh"

need=()
dpkg-query -W -f='${Status} ${Version}\n' etcd-server 2>/dev/null | grep -q "install ok installed 3.5" || need+=(etcd-server)
dpkg -s containernetworking-plugins >/dev/null 2>&1 || need+=(containernetworking-plugins)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]} (trixie)"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends -t trixie "${need[@]}" >/dev/null
fi
# Belt and braces: if a postinst started etcd anyway, stop the Debian service (we run our own).
if [ -x /etc/init.d/etcd ] && /etc/init.d/etcd status >/dev/null 2>&1; then
  /etc/init.d/etcd stop >/dev/null 2>&1 || true
fi
missing=()
for b in /usr/bin/etcd /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/lib/cni/loopback \
         /usr/bin/docker-registry /usr/local/bin/containerd /usr/sbin/runc /usr/sbin/criu \
         /bin/busybox openssl jq iptables ip findmnt flock; do
  command -v "$b" >/dev/null 2>&1 || [ -x "$b" ] || missing+=("$b")
done
[ ${#missing[@]} -eq 0 ] || { echo "error: still missing after install: ${missing[*]}" >&2; exit 1; }
log "etcd $(etcd --version | head -1 | awk '{print $3}'); CNI plugins in /usr/lib/cni"
