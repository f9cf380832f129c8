#!/usr/bin/env bash
# Tear the local test cluster down completely and idempotently, also after a failed or partial
# start: no processes, mounts, cgroups or network namespace of ours are left (the cluster's
# interfaces, routes and iptables rules all live in that namespace and go with it), and the state
# directories are removed (the binary cache is kept). Exits non-zero and says
# what is left if something could not be removed.
#
# Only processes of this cluster are stopped: by pid file, by membership of the nodes' own cgroup
# roots (the pods), or because their command line names this cluster's own state directories
# (containerd shims, daemons whose pid file was lost). Never by program name.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/cluster/lib.sh
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || ks_die "must run as root" "sudo $0"
ks_lock

# Pids whose command line mentions our state dirs (excluding this script and its ancestors).
our_pids() {
  local ancestors=" " p=$$ pid
  while [ -n "$p" ] && [ "$p" != 0 ] && [ "$p" != 1 ]; do
    ancestors+="$p "
    p="$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null)" || break
  done
  # patterns from a file, so that grep's own command line does not match
  grep -lsaF -f <(printf '%s\n' "$KS_DIR/" "$KS_RUN/") /proc/[0-9]*/cmdline 2>/dev/null | while IFS=/ read -r _ _ pid _; do
    [[ "$ancestors" == *" $pid "* ]] || echo "$pid"
  done
}

cgroup_pids() {  # pids in the nodes' cgroup roots, every hierarchy
  local node
  for node in "${KS_NODES[@]}"; do
    find /sys/fs/cgroup/*/"$node" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -u
}

# 1. kubelets first, so nothing restarts pods while we stop them.
ks_stop "${KS_NODES[@]/#/kubelet-}"

# 2. the pods: thaw frozen cgroups (a SIGKILL does not reach a frozen task), then kill.
for node in "${KS_NODES[@]}"; do
  find "/sys/fs/cgroup/freezer/$node" -name freezer.state 2>/dev/null | while read -r f; do
    echo THAWED >"$f" 2>/dev/null || true
  done
done
for _ in 1 2 3 4 5 6 7 8 9 10; do
  pids="$(cgroup_pids)"
  [ -n "$pids" ] || break
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  sleep 0.3
done

# 3. containerd, its shims, and the control plane.
ks_stop "${KS_NODES[@]/#/containerd-}" root-apiserver-relay apiserver-relay kube-scheduler \
  kube-controller-manager kube-apiserver etcd root-registry-relay registry-relay registry
for _ in 1 2 3 4 5 6 7 8 9 10; do
  pids="$(our_pids)"
  [ -n "$pids" ] || break
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  sleep 0.3
done

# 4. shim sockets in the shared /run/containerd/s (their paths are recorded in our bundles).
if [ -d "$KS_RUN" ]; then
  find "$KS_RUN" -path '*io.containerd.runtime.v2.task*' -name address -type f 2>/dev/null | while read -r f; do
    sock="$(sed 's#^unix://##' "$f")"
    case "$sock" in /run/containerd/s/*) rm -f "$sock" ;; esac
  done
fi

# 5. mounts under our dirs (overlay rootfs, netns, shm, kubelet volumes), deepest first.
for _ in 1 2 3; do
  mounts="$(findmnt -rn -o TARGET | grep -E "^($KS_DIR|$KS_RUN)(/|$)" | sort -r)"
  [ -n "$mounts" ] || break
  while read -r m; do
    m="$(printf '%b' "$m")"  # findmnt -r escapes blanks as \x20
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done <<<"$mounts"
done

# 5b. the memory work areas' tmpfs install-node mounted for the nodes' agents (shim/host/workfs.py: one per
# agent state dir, /dev/shm/kubectl-snapshot/KEY, KEY the first 16 hex digits of the dir's sha256).
for node in "${KS_NODES[@]}"; do
  key="$(printf '%s' "/var/lib/kubectl-snapshot/$node" | sha256sum | cut -c1-16)"
  area="/dev/shm/kubectl-snapshot/$key"
  if [ "$(findmnt -rn -o SOURCE --mountpoint "$area" 2>/dev/null | tail -1)" = kubectl-snapshot-work ]; then
    umount "$area" 2>/dev/null || umount -l "$area" 2>/dev/null || true
  fi
  rmdir "$area" 2>/dev/null || true
done
rmdir /dev/shm/kubectl-snapshot 2>/dev/null || true

# 6. cgroup roots, deepest first.
for node in "${KS_NODES[@]}"; do
  for h in /sys/fs/cgroup/*/"$node"; do
    [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
done

# 7. the cluster's network namespace, with everything in it (dummy, bridge, veths, NAT rules).
ip netns delete "$KS_NETNS" 2>/dev/null || true

# 8. kubelet symlinks into our pod logs, then the state dirs.
find /var/log/containers -maxdepth 1 -type l -lname "$KS_DIR/*" -delete 2>/dev/null || true
rm -rf "$KS_DIR" "$KS_RUN" 2>/dev/null || true

# 9. verify.
left=()
[ -z "$(our_pids)$(cgroup_pids)" ] || left+=("processes: $(our_pids) $(cgroup_pids)")
m="$(findmnt -rn -o TARGET | grep -E "^($KS_DIR|$KS_RUN)(/|$)")" && left+=("mounts: $m")
[ ! -e "/run/netns/$KS_NETNS" ] || left+=("network namespace $KS_NETNS")
for node in "${KS_NODES[@]}"; do
  for h in /sys/fs/cgroup/*/"$node"; do [ -d "$h" ] && left+=("cgroup $h"); done
done
[ ! -e "$KS_DIR" ] || left+=("dir $KS_DIR")
[ ! -e "$KS_RUN" ] || left+=("dir $KS_RUN")
if [ ${#left[@]} -gt 0 ]; then
  printf 'error: teardown left: %s\n' "${left[@]}" >&2
  exit 1
fi
ks_log "cluster is down (nothing left)"
