#!/usr/bin/env bash
# Kill one node of the local test cluster abruptly, as a power loss would: SIGKILL to its kubelet,
# its containerd, its containerd shims and every process of its pods (and anything else naming the
# node's state: a CRIU run of its runtime, say), all at once; nothing graceful, no pod is deleted,
# nothing is unmounted or cleaned up (the node's state stays as a crash leaves it). The control plane
# and the other node keep running; the API server sees the node stop reporting (NotReady after the
# controller-manager's node-monitor grace period). Idempotent: a node already dead is left as it is.
# Bring it back with hack/cluster/start-node.sh NODE.
#
# The cluster is shared: run it only under the e2e lock, e.g.
#   flock /run/ks-e2e.lock sh -c 'hack/cluster/kill-node.sh ks-n1; ...; hack/cluster/start-node.sh ks-n1'
# Usage: hack/cluster/kill-node.sh NODE
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/cluster/lib.sh
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || ks_die "must run as root" "sudo $0 $*"
[ $# = 1 ] || ks_die "usage: $0 NODE" "nodes are: ${KS_NODES[*]}"
node="$1"
ks_node_ip "$node" >/dev/null
[ -f "$KS_DIR/$node/containerd.toml" ] || ks_die "node $node has no state under $KS_DIR" \
  "bring the cluster up first: hack/cluster/up.sh"
ks_lock

# Everything of the node at one go: the two daemons by pid file, then every process whose command
# line names the node's own state (shims: -address $KS_RUN/NODE/containerd.sock; runc and CRIU runs
# on its bundles) and every process in the node's cgroup roots (its pods, the agent included).
# A frozen task (a save in progress) does not die of SIGKILL until thawed: thaw first.
node_pids() {
  local p
  for p in "kubelet-$node" "containerd-$node"; do
    ks_pid_of "$p" || true
  done
  grep -lsaF -f <(printf '%s\n' "$KS_RUN/$node/" "$KS_DIR/$node/") /proc/[0-9]*/cmdline 2>/dev/null \
    | while IFS=/ read -r _ _ pid _; do [ "$pid" != $$ ] && [ "$pid" != "$BASHPID" ] && echo "$pid"; done
  find /sys/fs/cgroup/*/"$node" -name cgroup.procs -exec cat {} + 2>/dev/null
}
thaw() {
  find "/sys/fs/cgroup/freezer/$node" -name freezer.state 2>/dev/null | while read -r f; do
    echo THAWED >"$f" 2>/dev/null || true
  done
}

killed=0
for _ in $(seq 1 20); do
  pids="$(node_pids | sort -un | while read -r p; do [ -n "$p" ] && ks_running "$p" && echo "$p"; done)"
  [ -n "$pids" ] || break
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  killed=$((killed + $(wc -w <<<"$pids")))
  thaw
  sleep 0.2
done
left="$(node_pids | sort -un | while read -r p; do [ -n "$p" ] && ks_running "$p" && echo "$p"; done)"
[ -z "$left" ] || ks_die "node $node: processes still alive after SIGKILL: $(echo $left)" \
  "look at them with ps -o pid,stat,args -p $(echo $left | tr ' ' ,); a process in D state waits on the kernel"
# The pid files stay: they name dead processes, which ks_alive reports as such (start-node.sh replaces them).
ks_log "node $node killed ($killed signals; kubelet, containerd, shims and pods are gone)"
