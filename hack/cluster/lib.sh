# shellcheck shell=bash
# Settings and helpers shared by hack/cluster/{up,down,containerd-restart}.sh (sourced, not run).
#
# Network layout (see docs/cluster.md): the whole cluster (etcd, API server, controllers, both
# nodes' kubelet + containerd, the registry, the pods' bridge) runs in one network namespace that
# these scripts create, "ks-net". It has no uplink (only lo, carrying the API server and node
# addresses, and the pod bridge), so nothing can leave the machine, and its addresses are real
# non-loopback ones: the kubelet refuses a loopback node IP and the API server refuses to proxy to
# one. The root namespace gets no interface, address, route or iptables rule; users and tests
# reach the API server and the registry at 127.0.0.1 through two relays joined by a Unix socket
# (hack/cluster/forward.py). Daemons enter the namespace with `nsenter --net` only, so they share
# the host's mount namespace (cgroups, container mounts and files stay visible as usual).

KS_K8S_VERSION="${K8S_VERSION:-v1.36.3}"
KS_DIR="${KS_CLUSTER_DIR:-/var/lib/ks-cluster}"      # persistent state (PKI, etcd, node dirs)
KS_RUN="${KS_CLUSTER_RUN:-/run/ks-cluster}"          # sockets, pids, containerd state
KS_NODES=(ks-n1 ks-n2)
KS_NETNS=ks-net
KS_API_IP=10.213.0.1                                 # in ks-net
KS_API_ADDR=127.0.0.1                                # root namespace (relay) and ks-net loopback
KS_API_PORT="${KS_API_PORT:-6443}"
KS_ETCD_PORT="${KS_ETCD_PORT:-23790}"
KS_REGISTRY="${KS_REGISTRY:-127.0.0.1:5005}"
KS_POD_CIDR=10.244.0.0/16
KS_SERVICE_CIDR=10.96.0.0/16
KS_BRIDGE=ks-br0
KS_IMAGE_PREFIX="$KS_REGISTRY/kubectl-snapshot"
KS_PAUSE_IMAGE="$KS_IMAGE_PREFIX/pause:3.10-ks"
KS_BUSYBOX_IMAGE="$KS_IMAGE_PREFIX/busybox:1.37"
KS_PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # criu, runc in /usr/sbin
# The nodes' containerd: empty for the installed one (/usr/local/bin, v2.3.x), or a release that
# hack/build-containerd.sh builds and caches (e.g. v1.7.35). Read when a node's config is written
# (up.sh); the node keeps it ($KS_DIR/NODE/containerd.bin) for later restarts.
KS_CONTAINERD_VERSION="${KS_CONTAINERD_VERSION:-}"
KS_HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

ks_log() { printf '[cluster] %s\n' "$*" >&2; }
ks_die() { printf 'error: %s\n' "$1" >&2; [ -z "${2:-}" ] || printf 'hint: %s\n' "$2" >&2; exit 1; }

ks_node_ip() {  # NODE -> its address in ks-net
  case "$1" in
    ks-n1) echo 10.213.0.11 ;;
    ks-n2) echo 10.213.0.12 ;;
    *) ks_die "unknown node '$1'" "nodes are: ${KS_NODES[*]}" ;;
  esac
}
ks_node_sock() { echo "$KS_RUN/$1/containerd.sock"; }
ks_node_dropins() { echo "$KS_DIR/$1/containerd.d"; }

# One cluster operation at a time (up, down, containerd restart, and the pytest fixture, which
# sets KS_LOCK_HELD when it holds the lock itself). Daemons must not inherit the lock's fd.
ks_lock() {
  [ -z "${KS_LOCK_HELD:-}" ] || return 0
  mkdir -p "$(dirname "$KS_RUN")"
  exec 8>"$KS_RUN.lock"
  flock 8
  export KS_LOCK_HELD=1
}

# A pid file holds "PID BOOT_ID STARTTIME": a pid alone is not an identity. A pid file that
# outlived its process (a machine rebooted from a disk image taken while a cluster ran, a daemon
# that died) names whatever holds that number now, e.g. the very `make demo` that is cleaning up;
# the boot id and the process's start time (/proc/PID/stat field 22) tell it apart.
ks_pidfile() { echo "$KS_RUN/pids/$1.pid"; }
ks_proc_id() {  # PID: "BOOT_ID STARTTIME" of that live, non-zombie process; fails if there is none
  local stat boot
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" && [ -n "$stat" ] || return 1
  boot="$(cat /proc/sys/kernel/random/boot_id)" || return 1
  # fields 3.. follow the last ") " (the command name may hold blanks and parentheses)
  # shellcheck disable=SC2086
  set -- ${stat##*) }
  [ "$1" != Z ] && [ -n "${20:-}" ] || return 1
  echo "$boot ${20}"
}
ks_pid_of() {  # NAME: the pid of the daemon its pid file names, if that very process still runs
  local f pid id
  f="$(ks_pidfile "$1")"
  [ -f "$f" ] || return 1
  read -r pid id <"$f" || [ -n "$pid" ] || return 1
  [[ "$pid" =~ ^[0-9]+$ ]] && [ -n "$id" ] && [ "$(ks_proc_id "$pid")" = "$id" ] || return 1
  echo "$pid"
}
ks_alive() { ks_pid_of "$1" >/dev/null; }  # NAME: is the daemon from its pid file running?

ks_net() { nsenter --net="/run/netns/$KS_NETNS" "$@"; }  # CMD... inside ks-net

# Start a daemon in its own session (it must outlive the caller, e.g. pytest), log to a file and
# record its pid so down.sh can stop exactly it. It runs in ks-net unless NAME starts with "root-".
# No inherited fd but stdio: a caller's lock (`flock /run/ks-e2e.lock hack/cluster-up`, fd 3) held
# open by a daemon would keep every other e2e run waiting until the cluster goes down.
ks_start() {  # NAME CMD...
  local name="$1"; shift
  mkdir -p "$KS_DIR/logs" "$KS_RUN/pids"
  local netns=()
  # nsenter execs the command, so the pid stays the daemon's.
  [[ "$name" == root-* ]] || netns=(nsenter --net="/run/netns/$KS_NETNS")
  (
    # A daemon outlives its caller, so it keeps none of the caller's files: not the cluster lock
    # (fd 8), and not a lock the caller holds, e.g. `flock /run/ks-e2e.lock hack/cluster-up` passes
    # the e2e lock as fd 3, which every daemon would otherwise hold until the cluster goes down.
    for fd in /proc/$BASHPID/fd/*; do
      fd="${fd##*/}"
      [ "$fd" -gt 2 ] && eval "exec $fd>&-"
    done
    PATH="$KS_PATH" exec setsid "${netns[@]}" "$@"
  ) >>"$KS_DIR/logs/$name.log" 2>&1 </dev/null &
  # the subshell's pid and start time stay the daemon's: setsid and nsenter exec in place
  echo "$! $(ks_proc_id $! || echo gone)" >"$(ks_pidfile "$name")"
}

ks_running() { ks_proc_id "$1" >/dev/null; }  # PID: alive and not a zombie (PID 1 reaps orphans only now and then)

ks_same_proc() { [ "$(ks_proc_id "${1%%:*}")" = "${1#*:}" ]; }  # PID:ID: still that process?

ks_stop() {  # [-t TIMEOUT_S] NAME...: SIGTERM all, wait, then SIGKILL what is left
  local timeout=10 pid ids=() i alive
  if [ "${1:-}" = -t ]; then timeout="$2"; shift 2; fi
  for name in "$@"; do
    pid="$(ks_pid_of "$name")" || pid=""
    rm -f "$(ks_pidfile "$name")"
    # only the process the pid file recorded: a stale file's number may be anyone's now
    [ -n "$pid" ] && ids+=("$pid:$(ks_proc_id "$pid")") && { kill -TERM "$pid" 2>/dev/null || true; }
  done
  for ((i = 0; i < timeout * 10; i++)); do
    alive=0
    for pid in "${ids[@]}"; do ks_same_proc "$pid" && { alive=1; break; }; done
    [ "$alive" = 1 ] || return 0
    sleep 0.1
  done
  for pid in "${ids[@]}"; do ks_same_proc "$pid" && kill -KILL "${pid%%:*}" 2>/dev/null; done
  sleep 0.2
  return 0
}

ks_wait() {  # TIMEOUT_S DESCRIPTION CMD...: poll CMD until it succeeds
  local timeout="$1" what="$2" start
  shift 2
  start=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    if (( $(date +%s) - start >= timeout )); then
      ks_log "timed out after ${timeout}s waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

ks_containerd_config() {  # NODE: write the node's containerd config (and which containerd runs it)
  local node="$1" bin=/usr/local/bin
  mkdir -p "$KS_DIR/$node" "$(ks_node_dropins "$node")"
  if [ -n "$KS_CONTAINERD_VERSION" ]; then
    bin="$("$KS_HACK/build-containerd.sh" "$KS_CONTAINERD_VERSION")" \
      || ks_die "containerd $KS_CONTAINERD_VERSION could not be built" "see the output of hack/build-containerd.sh above"
  fi
  echo "$bin" >"$KS_DIR/$node/containerd.bin"
  # containerd 2.0 names the CNI plugin directory `bin_dir` (one); 2.1 and later `bin_dirs` (a list)
  local cni_bins="bin_dirs = ['/usr/lib/cni']"
  case "$("$bin/containerd" --version | awk '{print $3}')" in
    v1.*|1.*) ks_containerd_config_v2 "$node"; return ;;
    v2.0.*|2.0.*) cni_bins="bin_dir = '/usr/lib/cni'" ;;
  esac
  cat >"$KS_DIR/$node/containerd.toml" <<EOF
# containerd v2.3.x config for test node $node (written by hack/cluster/lib.sh).
version = 3
root = "$KS_DIR/$node/containerd"
state = "$KS_RUN/$node/containerd"
# Drop-ins (version = 3 files) for this node only, e.g. the kubectl-snapshot runtime handler.
# Apply them with hack/cluster/containerd-restart.sh $node.
imports = ["$(ks_node_dropins "$node")/*.toml"]

[grpc]
  address = "$(ks_node_sock "$node")"

[debug]
  address = ""

[metrics]
  address = ""

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '$KS_PAUSE_IMAGE'
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = '$KS_DIR/certs.d'

[plugins.'io.containerd.cri.v1.runtime']
  # The VM lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj to the kubelet's -998.
  restrict_oom_score_adj = true
  enable_criu = true
  # The project restores through its own runtime wrapper, never through CRI restore-via-create.
  enable_experimental_restore_via_create = false
  # Pod network namespaces under this node's state dir, so teardown finds them.
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = '/usr/sbin/runc'
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    $cni_bins
    conf_dir = '$KS_DIR/cni/net.d'
EOF
}

# containerd 1.7 reads config version 2 only (its CRI plugin is one table, io.containerd.grpc.v1.cri).
ks_containerd_config_v2() {  # NODE: the same settings as ks_containerd_config, for containerd 1.x
  local node="$1"
  cat >"$KS_DIR/$node/containerd.toml" <<EOF
# containerd v1.7.x config for test node $node (written by hack/cluster/lib.sh).
version = 2
root = "$KS_DIR/$node/containerd"
state = "$KS_RUN/$node/containerd"
# Drop-ins (version = 2 files) for this node only, e.g. the kubectl-snapshot runtime handler.
# Apply them with hack/cluster/containerd-restart.sh $node.
imports = ["$(ks_node_dropins "$node")/*.toml"]

[grpc]
  address = "$(ks_node_sock "$node")"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.nri.v1.nri"]
  disable = true

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = '$KS_PAUSE_IMAGE'
  # The VM lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj to the kubelet's -998.
  restrict_oom_score_adj = true
  # Pod network namespaces under this node's state dir, so teardown finds them.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = '$KS_DIR/certs.d'
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = 'overlayfs'
    default_runtime_name = 'runc'
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = '/usr/sbin/runc'
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = '/usr/lib/cni'
    conf_dir = '$KS_DIR/cni/net.d'
EOF
}

ks_containerd_bin() {  # NODE -> the directory of the containerd (and its shim and ctr) the node runs
  cat "$KS_DIR/$1/containerd.bin" 2>/dev/null || echo /usr/local/bin
}

ks_start_containerd() {  # NODE
  local node="$1" bin
  bin="$(ks_containerd_bin "$node")"
  mkdir -p "$KS_RUN/$node"
  # containerd starts the runc shim it finds first on PATH: its own release's.
  KS_PATH="$bin:$KS_PATH" ks_start "containerd-$node" "$bin/containerd" --config "$KS_DIR/$node/containerd.toml"
  ks_wait 30 "containerd on $node" "$bin/ctr" --address "$(ks_node_sock "$node")" version \
    || ks_die "containerd on $node did not start" "see $KS_DIR/logs/containerd-$node.log"
}

ks_kubelet_config() {  # NODE: write the node's kubelet configuration
  local node="$1" ip
  ip="$(ks_node_ip "$node")"
  local PKI="$KS_DIR/pki"
  mkdir -p "$KS_DIR/$node/kubelet" "$KS_DIR/$node/pod-logs"
  cat >"$KS_DIR/$node/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: $ip
healthzPort: 10248
containerRuntimeEndpoint: unix://$(ks_node_sock "$node")
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: /$node
failCgroupV1: false
failSwapOn: false
podLogsDir: $KS_DIR/$node/pod-logs
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
featureGates: {ContainerCheckpoint: true}
resolvConf: ""
makeIPTablesUtilChains: false
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
oomScoreAdj: 0
EOF
}

# The kubelet's device manager listens on a fixed host path, not under --root-dir, after removing what
# is there: two kubelets reaching it at once race for it ("bind: address already in use", and the
# loser exits: "Failed to start ContainerManager"). So a kubelet is started only once the one before
# it has bound its socket (the path removed first, so that an old socket cannot pass for the new one).
KS_DEVICE_PLUGIN_SOCK=/var/lib/kubelet/device-plugins/kubelet.sock

ks_start_kubelet() {  # NODE BIN_DIR
  local node="$1" BIN="$2" ip
  ip="$(ks_node_ip "$node")"
  rm -f "$KS_DEVICE_PLUGIN_SOCK"
  ks_start "kubelet-$node" "$BIN/kubelet" --config="$KS_DIR/$node/kubelet.yaml" \
    --kubeconfig="$KS_DIR/$node.kubeconfig" --root-dir="$KS_DIR/$node/kubelet" \
    --hostname-override="$node" --node-ip="$ip" --v=1
  ks_wait 90 "the kubelet of $node to open its device plugin socket" test -S "$KS_DEVICE_PLUGIN_SOCK" \
    || ks_die "the kubelet of $node did not start its device manager" "see $KS_DIR/logs/kubelet-$node.log"
}
