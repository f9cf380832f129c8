#!/usr/bin/env bash
# Restart one test node's containerd so that it re-reads its config and drop-ins
# ($KS_DIR/NODE/containerd.d/*.toml, e.g. the kubectl-snapshot runtime handler that the node agent
# installs). Running containers keep running: their shims outlive containerd, and the kubelet
# reconnects to the socket. Usage: hack/cluster/containerd-restart.sh ks-n1
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/cluster/lib.sh
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || ks_die "must run as root" "sudo $0 $*"
[ $# = 1 ] || ks_die "usage: $0 NODE" "nodes are: ${KS_NODES[*]}"
ks_lock
node="$1"
ks_node_ip "$node" >/dev/null
[ -f "$KS_DIR/$node/containerd.toml" ] || ks_die "node $node has no containerd config" "bring the cluster up first: hack/cluster/up.sh"
ks_stop -t 20 "containerd-$node"
ks_start_containerd "$node"
ks_log "containerd on $node restarted ($(ls "$(ks_node_dropins "$node")" 2>/dev/null | wc -l) drop-in(s))"
