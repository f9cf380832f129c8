#!/usr/bin/env bash
# Bring up the local two-node test cluster (etcd, kube-apiserver, controller-manager, scheduler,
# two kubelets each with its own containerd, a local registry with pause + busybox images) and
# print how to use it. Reuses a running cluster; cleans up a half-started one first.
# Needs root, hack/cluster/install-deps.sh, and the binaries of hack/cluster/build.sh (built here
# if not cached). Usage: hack/cluster/up.sh   (then: source /var/lib/ks-cluster/cluster.env)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/cluster/lib.sh
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || ks_die "must run as root" "sudo $0"
ks_lock
for b in /usr/bin/etcd /usr/lib/cni/bridge /usr/bin/docker-registry /usr/local/bin/containerd /usr/sbin/runc /usr/sbin/criu /bin/busybox; do
  [ -x "$b" ] || ks_die "$b is missing" "run hack/cluster/install-deps.sh first"
done

t0=$(date +%s)
BIN="$("$HERE/build.sh")"
PKI="$KS_DIR/pki"
KUBECTL=("$BIN/kubectl" --kubeconfig "$KS_DIR/admin.kubeconfig")

print_usage() {
  cat <<EOF
Cluster is up ($(( $(date +%s) - t0 ))s). Kubernetes $KS_K8S_VERSION, containerd $("$(ks_containerd_bin ks-n1)/containerd" --version | awk '{print $3}').
  export KUBECONFIG=$KS_DIR/admin.kubeconfig     # or: source $KS_DIR/cluster.env
  kubectl:   $BIN/kubectl
  API:       https://$KS_API_ADDR:$KS_API_PORT (relay into network namespace $KS_NETNS, where it is
             https://$KS_API_IP:$KS_API_PORT; pods also reach it as https://10.96.0.1:443)
  registry:  $KS_REGISTRY  (same address in $KS_NETNS; plain HTTP; images: $KS_PAUSE_IMAGE, $KS_BUSYBOX_IMAGE)
  nodes:     ${KS_NODES[*]} ($(ks_node_ip ks-n1), $(ks_node_ip ks-n2); containerd sockets: $(ks_node_sock ks-n1), $(ks_node_sock ks-n2))
  containerd drop-ins: $KS_DIR/NODE/containerd.d/*.toml, then hack/cluster/containerd-restart.sh NODE
  checkpoints land in: $KS_DIR/NODE/kubelet/checkpoints/
  logs:      $KS_DIR/logs/
  tear down: hack/cluster/down.sh
EOF
}

# Daemons alive: give a busy machine a minute before calling the cluster broken (others may be
# using it; a teardown would pull it from under their tests).
if ks_alive kube-apiserver && ks_alive kubelet-ks-n1 && ks_alive kubelet-ks-n2 \
   && ks_wait 60 "the running cluster's API server" "${KUBECTL[@]}" get --raw /readyz; then
  ks_log "already running"
  print_usage
  exit 0
fi
if [ -e "$KS_DIR" ] || [ -e "$KS_RUN" ]; then
  ks_log "cleaning up a previous (partial) cluster"
  "$HERE/down.sh"
fi

# Anything failing from here on leaves a partial cluster: tear it down unless asked to keep it.
on_error() {
  ks_log "bring-up failed; logs in $KS_DIR/logs (kept in ${KS_DIR}-failed-logs)"
  rm -rf "${KS_DIR}-failed-logs"; cp -r "$KS_DIR/logs" "${KS_DIR}-failed-logs" 2>/dev/null || true
  tail -n 20 "$KS_DIR"/logs/*.log >&2 2>/dev/null || true
  [ "${KS_KEEP_ON_FAILURE:-0}" = 1 ] || "$HERE/down.sh" >&2 || true
}
trap 'rc=$?; [ "$rc" = 0 ] || on_error; exit "$rc"' EXIT
mkdir -p "$KS_DIR" "$KS_RUN/pids" "$KS_RUN/fwd" "$PKI" "$KS_DIR/logs"

# --- the cluster's network namespace ---------------------------------------------------------
ks_log "creating network namespace $KS_NETNS"
ip netns add "$KS_NETNS"
ip -n "$KS_NETNS" link set lo up
# The API server and node addresses sit on the namespace's lo (the kernel has no dummy driver);
# they are still real, non-loopback addresses to the kubelet and the API server.
for a in "$KS_API_IP" $(for n in "${KS_NODES[@]}"; do ks_node_ip "$n"; done); do
  ip -n "$KS_NETNS" addr add "$a/32" dev lo
done
# No kube-proxy: the kubernetes Service IP (first of the service CIDR) is DNATed to the API server
# for pods and host-network processes alike; other service IPs go nowhere. These rules live in
# ks-net and vanish with it.
ip -n "$KS_NETNS" route add "$KS_SERVICE_CIDR" dev lo
for chain in PREROUTING OUTPUT; do
  ks_net iptables -t nat -A "$chain" -d 10.96.0.1/32 -p tcp --dport 443 \
    -j DNAT --to-destination "$KS_API_IP:$KS_API_PORT"
done

# --- PKI -------------------------------------------------------------------------------------
ks_log "generating certificates"
openssl_quiet() { openssl "$@" 2>/dev/null; }
openssl_quiet req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -days 3650 \
  -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -subj "/CN=kubectl-snapshot-test-ca" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
cert() {  # NAME SUBJECT EXTENSIONS
  openssl_quiet req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
    -keyout "$PKI/$1.key" -out "$PKI/$1.csr" -subj "$2"
  printf '%s\n' "$3" >"$PKI/$1.ext"
  openssl_quiet x509 -req -in "$PKI/$1.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -out "$PKI/$1.crt" -extfile "$PKI/$1.ext"
}
client_ext="basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
cert apiserver "/CN=kube-apiserver" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:10.96.0.1,IP:$KS_API_IP"
cert admin "/O=system:masters/CN=kubectl-snapshot-admin" "$client_ext"
cert apiserver-kubelet-client "/CN=kube-apiserver-kubelet-client" "$client_ext"
cert controller-manager "/CN=system:kube-controller-manager" "$client_ext"
cert scheduler "/CN=system:kube-scheduler" "$client_ext"
for node in "${KS_NODES[@]}"; do
  cert "kubelet-$node" "/O=system:nodes/CN=system:node:$node" "$client_ext"
done
openssl_quiet genrsa -out "$PKI/sa.key" 2048
openssl_quiet rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub"
chmod 600 "$PKI"/*.key

kubeconfig() {  # FILE CERT-NAME [SERVER]
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ks
  cluster:
    server: ${3:-https://$KS_API_ADDR:$KS_API_PORT}
    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(base64 -w0 "$PKI/$2.crt")
    client-key-data: $(base64 -w0 "$PKI/$2.key")
contexts:
- name: ks
  context: {cluster: ks, user: $2}
current-context: ks
EOF
  chmod 600 "$1"
}
kubeconfig "$KS_DIR/admin.kubeconfig" admin
kubeconfig "$KS_DIR/controller-manager.kubeconfig" controller-manager
kubeconfig "$KS_DIR/scheduler.kubeconfig" scheduler
for node in "${KS_NODES[@]}"; do
  kubeconfig "$KS_DIR/$node.kubeconfig" "kubelet-$node" "https://$KS_API_IP:$KS_API_PORT"
done

# --- registry and images ---------------------------------------------------------------------
ks_log "starting registry on $KS_REGISTRY and pushing images"
mkdir -p "$KS_DIR/registry"
cat >"$KS_DIR/registry.yml" <<EOF
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $KS_DIR/registry}
  delete: {enabled: true}
http: {addr: $KS_REGISTRY}
EOF
PY="$(command -v python3)"
relay() {  # NAME TCP-ADDR: a relay from the root namespace to the same address in ks-net
  local name
  ks_start "$1-relay" "$PY" "$HERE/forward.py" "unix:$KS_RUN/fwd/$1.sock" "tcp:$2"
  ks_start "root-$1-relay" "$PY" "$HERE/forward.py" "tcp:$2" "unix:$KS_RUN/fwd/$1.sock"
  for name in "$1-relay" "root-$1-relay"; do
    ks_wait 20 "$name" relay_started "$name"
    ks_alive "$name" || ks_die "the $name relay failed (port $2 in use?): $(tail -1 "$KS_DIR/logs/$name.log")" \
      "free it, or choose other ports with KS_API_PORT=PORT / KS_REGISTRY=127.0.0.1:PORT"
  done
}
relay_started() { grep -q "^listening on" "$KS_DIR/logs/$1.log" || ! ks_alive "$1"; }
ks_start registry /usr/bin/docker-registry serve "$KS_DIR/registry.yml"
relay registry "$KS_REGISTRY"
ks_wait 20 "registry" curl -fsS "http://$KS_REGISTRY/v2/"
mkdir -p "$KS_DIR/images"
( cd "$HERE/pause" && CGO_ENABLED=0 GOFLAGS= go build -trimpath -ldflags "-s -w" -o "$KS_DIR/images/pause-bin" pause.go )
python3 "$HERE/oci_image.py" --layout "$KS_DIR/images/pause" --ref "$KS_PAUSE_IMAGE" \
  --file "$KS_DIR/images/pause-bin:/pause" --entrypoint /pause --push >/dev/null
python3 "$HERE/oci_image.py" --layout "$KS_DIR/images/busybox" --ref "$KS_BUSYBOX_IMAGE" \
  --busybox /bin/busybox --dir /tmp --dir /root --dir /etc --cmd sh --push >/dev/null
mkdir -p "$KS_DIR/certs.d/$KS_REGISTRY"
cat >"$KS_DIR/certs.d/$KS_REGISTRY/hosts.toml" <<EOF
server = "http://$KS_REGISTRY"
[host."http://$KS_REGISTRY"]
  capabilities = ["pull", "resolve", "push"]
EOF

# --- control plane ---------------------------------------------------------------------------
ks_log "starting etcd and the control plane"
ks_start etcd /usr/bin/etcd --name ks --data-dir "$KS_DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$KS_ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$KS_ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$((KS_ETCD_PORT + 10))" \
  --initial-advertise-peer-urls "http://127.0.0.1:$((KS_ETCD_PORT + 10))" \
  --initial-cluster "ks=http://127.0.0.1:$((KS_ETCD_PORT + 10))" --unsafe-no-fsync --log-level warn
ks_wait 30 "etcd" ks_net curl -fsS "http://127.0.0.1:$KS_ETCD_PORT/health"

ks_start kube-apiserver "$BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$KS_ETCD_PORT" \
  --bind-address=0.0.0.0 --secure-port="$KS_API_PORT" --advertise-address="$KS_API_IP" \
  --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
  --client-ca-file="$PKI/ca.crt" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
  --service-cluster-ip-range="$KS_SERVICE_CIDR" \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
  --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
  --kubelet-preferred-address-types=InternalIP \
  --allow-privileged=true --profiling=false --v=1
relay apiserver "$KS_API_ADDR:$KS_API_PORT"
ks_wait 90 "kube-apiserver /readyz" "${KUBECTL[@]}" get --raw /readyz

# The apiserver calls kubelets as kube-apiserver-kubelet-client: logs/exec need
# system:kubelet-api-admin, and the checkpoint API needs `create nodes/checkpoint`, which that
# built-in role lacks (kubernetes#126232).
"${KUBECTL[@]}" apply -f - >/dev/null <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "kubectl-snapshot:kubelet-checkpoint"}
rules:
- {apiGroups: [""], resources: ["nodes/checkpoint"], verbs: ["create"]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubectl-snapshot:apiserver-kubelet-checkpoint"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "kubectl-snapshot:kubelet-checkpoint"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kubectl-snapshot:apiserver-kubelet-api-admin"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:kubelet-api-admin"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}]
EOF

ks_start kube-controller-manager "$BIN/kube-controller-manager" \
  --kubeconfig="$KS_DIR/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$KS_DIR/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$KS_DIR/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
  --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
  --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
  --service-cluster-ip-range="$KS_SERVICE_CIDR" --profiling=false --v=1
ks_start kube-scheduler "$BIN/kube-scheduler" \
  --kubeconfig="$KS_DIR/scheduler.kubeconfig" \
  --authentication-kubeconfig="$KS_DIR/scheduler.kubeconfig" \
  --authorization-kubeconfig="$KS_DIR/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --leader-elect=false --profiling=false --v=1

# --- pod network (inside ks-net): pods route only the service CIDR and the cluster addresses
# (API server, nodes) via the bridge; no default route, and ks-net itself has no uplink ---------
mkdir -p "$KS_DIR/cni/net.d" "$KS_DIR/cni/ipam"
cat >"$KS_DIR/cni/net.d/10-ks-pods.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "ks-pods",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$KS_BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$KS_POD_CIDR"}]],
        "routes": [{"dst": "$KS_SERVICE_CIDR"}, {"dst": "${KS_API_IP%.*}.0/24"}],
        "dataDir": "$KS_DIR/cni/ipam"
      }
    }
  ]
}
EOF

# --- nodes -----------------------------------------------------------------------------------
for node in "${KS_NODES[@]}"; do
  ks_log "starting node $node ($(ks_node_ip "$node"))"
  # Each kubelet owns a cgroup root in every v1 hierarchy (it validates them at start).
  for h in /sys/fs/cgroup/*/; do
    [ -e "$h/cgroup.procs" ] && [ "$h" != /sys/fs/cgroup/unified/ ] || continue
    mkdir -p "$h/$node"
    if [ -e "$h/cpuset.cpus" ]; then
      cat "$h/cpuset.cpus" >"$h/$node/cpuset.cpus"
      cat "$h/cpuset.mems" >"$h/$node/cpuset.mems"
    fi
  done
  ks_containerd_config "$node"
  ks_start_containerd "$node"

  ks_kubelet_config "$node"
  ks_start_kubelet "$node" "$BIN"
done

for node in "${KS_NODES[@]}"; do ks_wait 90 "node $node to register" "${KUBECTL[@]}" get node "$node"; done
"${KUBECTL[@]}" wait --for=condition=Ready "${KS_NODES[@]/#/node/}" --timeout=120s >/dev/null
ks_wait 60 "default service account" "${KUBECTL[@]}" get serviceaccount default -n default

cat >"$KS_DIR/cluster.env" <<EOF
export KUBECONFIG=$KS_DIR/admin.kubeconfig
export KS_KUBECTL=$BIN/kubectl
export KS_REGISTRY=$KS_REGISTRY
export KS_API_HOST=$KS_API_ADDR
export KS_API_IP=$KS_API_IP
export KS_NETNS=$KS_NETNS
export KS_API_PORT=$KS_API_PORT
export KS_NODES="${KS_NODES[*]}"
export KS_BUSYBOX_IMAGE=$KS_BUSYBOX_IMAGE
export KS_PAUSE_IMAGE=$KS_PAUSE_IMAGE
export PATH=$BIN:\$PATH
EOF
trap - EXIT
print_usage
