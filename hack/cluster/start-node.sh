#!/usr/bin/env bash
# Bring one node of the local test cluster back after hack/cluster/kill-node.sh (or any crash of its
# daemons): start its containerd and kubelet with the configuration up.sh wrote, wait until the node
# is Ready, take the out-of-service taint off it (docs/node-loss.md: once the node is healthy again
# the operator or the automation removes it), and wait until every DaemonSet pod bound to it (the
# kubectl-snapshot agent, when installed) runs and is Ready again. Idempotent: daemons that run are
# kept, so on a healthy node it only checks.
# Usage: hack/cluster/start-node.sh NODE   (under the e2e lock, like kill-node.sh)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/cluster/lib.sh
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || ks_die "must run as root" "sudo $0 $*"
[ $# = 1 ] || ks_die "usage: $0 NODE" "nodes are: ${KS_NODES[*]}"
node="$1"
ks_node_ip "$node" >/dev/null
for f in "$KS_DIR/$node/containerd.toml" "$KS_DIR/$node/kubelet.yaml" "$KS_DIR/cluster.env"; do
  [ -f "$f" ] || ks_die "$f is missing: node $node was never set up" "bring the cluster up first: hack/cluster/up.sh"
done
ks_lock
BIN="$("$HERE/build.sh")"
KUBECTL=("$BIN/kubectl" --kubeconfig "$KS_DIR/admin.kubeconfig")
t0=$(date +%s)

since=""  # when the node's daemons were restarted (its pods' containers must have started since)
if ! ks_alive "containerd-$node"; then
  ks_log "starting containerd on $node"
  since="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  ks_start_containerd "$node"
fi
if ! ks_alive "kubelet-$node"; then
  ks_log "starting the kubelet on $node"
  ks_start_kubelet "$node" "$BIN"
fi
"${KUBECTL[@]}" wait --for=condition=Ready "node/$node" --timeout=180s >/dev/null \
  || ks_die "node $node is not Ready after 180s" "see $KS_DIR/logs/kubelet-$node.log and containerd-$node.log"
"${KUBECTL[@]}" taint node "$node" node.kubernetes.io/out-of-service- >/dev/null 2>&1 || true

# Every DaemonSet counts all its pods Ready (its status, which the controller updates from the
# node's pods), and every DaemonSet pod bound to this node is Ready, not terminating, and (after a
# restart here) runs containers started since: a status from before the kill would look Ready too.
daemons_ready() {
  local sets pods
  sets="$("${KUBECTL[@]}" get daemonsets -A -o json)" || return 1
  pods="$("${KUBECTL[@]}" get pods -A -o json --field-selector "spec.nodeName=$node")" || return 1
  python3 - "$sets" "$pods" "$since" <<'PY'
import json, sys
sets, pods = (json.loads(a)["items"] for a in sys.argv[1:3])
since = sys.argv[3]  # RFC 3339 UTC strings compare in time order
ok = all(d["status"].get("numberReady", 0) == d["status"].get("desiredNumberScheduled", 0) for d in sets)
for p in pods:
    if any(o.get("kind") == "DaemonSet" for o in p["metadata"].get("ownerReferences") or []):
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
        started = [(c.get("state") or {}).get("running", {}).get("startedAt") or "" for c in p["status"].get("containerStatuses") or []]
        fresh = bool(started) and all(t >= since for t in started)  # not the status from before the kill
        ok = ok and ready and fresh and not p["metadata"].get("deletionTimestamp")
sys.exit(0 if ok else 1)
PY
}
if ! ks_wait 240 "the DaemonSet pods on $node to be Ready" daemons_ready; then
  "${KUBECTL[@]}" get pods -A -o wide --field-selector "spec.nodeName=$node" >&2 || true
  ks_die "DaemonSet pods on $node are not Ready after 240s" "see kubectl describe pod -n NAMESPACE POD and $KS_DIR/logs/kubelet-$node.log"
fi
ks_log "node $node is Ready with its DaemonSet pods ($(( $(date +%s) - t0 ))s)"
