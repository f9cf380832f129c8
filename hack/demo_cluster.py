#!/usr/bin/env python3
"""The demo: the local two-node Kubernetes cluster (built from source), the agent installed with
`kubectl snapshot install`, a counter pod on node 1 snapshotted with `kubectl snapshot`, deleted,
and restored with `kubectl snapshot restore` on node 2, where it counts on from where it was.

Run through `make demo` (which installs and builds what it needs first). Everything stays on loopback
and in the cluster's own network namespace. The cluster is left running (`hack/cluster-down` removes it).

`--check` (`hack/demo.sh --check`) only checks that the demo's cluster still works: every node Ready,
the agent rolled out and Ready on each, `kubectl snapshot doctor` clean. CI runs it after `make test`
has run on the demo's cluster (.ci/run).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from kubectl_snapshot.core import kubenames as K

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV_FILE = Path(os.environ.get("KS_CLUSTER_DIR", "/var/lib/ks-cluster")) / "cluster.env"
NS = "demo"
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; echo count $i; sleep 1; done"


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(*args: str, show: bool = True, env: dict[str, str] | None = None) -> str:
    if show:
        print("$ " + " ".join(shlex.quote(a) for a in args), flush=True)
    proc = subprocess.run(args, text=True, stdout=subprocess.PIPE, env=env)
    if proc.returncode != 0:
        print(proc.stdout.rstrip(), flush=True)  # what it said before it failed (doctor's table, say)
        raise SystemExit(f"demo: `{' '.join(args)}` failed ({proc.returncode})")
    if show and proc.stdout.strip():
        print(proc.stdout.rstrip(), flush=True)
    return proc.stdout.strip()


def cluster_env() -> dict[str, str]:
    env = dict(os.environ)
    for line in ENV_FILE.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value.strip('"')
    env["PATH"] = f"{BIN}:{Path(env['KS_KUBECTL']).parent}:{env['PATH']}"
    return env


def main() -> None:
    say("bringing up the local two-node cluster (built from source; reused if already running)")
    subprocess.run([str(REPO / "hack" / "cluster-up")], check=True, stdout=subprocess.DEVNULL)
    env = cluster_env()
    registry, nodes = env["KS_REGISTRY"], env["KS_NODES"].split()
    n1, n2 = nodes[0], nodes[1]

    def kubectl(*args: str, show: bool = True) -> str:
        return run("kubectl", *args, show=show, env=env)

    kubectl("get", "nodes", "-o", "wide")

    say("building the agent image and installing kubectl-snapshot into the cluster")
    image = run(str(REPO / "hack" / "build-agent-image.sh"), f"{registry}/kubectl-snapshot/agent:demo", show=False)
    image = image.splitlines()[-1]
    state = Path(env.get("KS_CLUSTER_DIR", "/var/lib/ks-cluster"))
    node_config = state / "demo-nodes.json"
    node_config.write_text(json.dumps({
        n: {
            "containerd_socket": f"{env.get('KS_CLUSTER_RUN', '/run/ks-cluster')}/{n}/containerd.sock",
            "kubelet_root": str(state / n / "kubelet"),
            "containerd_dropin_dir": str(state / n / "containerd.d"),
            # the nodes share this machine's network (--host-network): a metrics port each
            "metrics_bind_address": f":{9443 + i}",
        }
        for i, n in enumerate(nodes)
    }))  # fmt: skip
    # --host-network: the local registry listens on this machine's loopback only
    run("kubectl-snapshot", "install", "--agent-image", image,
        "--api-server", f"https://{env['KS_API_HOST']}:{env['KS_API_PORT']}", "--node-config", str(node_config),
        "--restart-command", f"{REPO / 'hack' / 'cluster' / 'containerd-restart.sh'} {{node}}",
        "--host-network", env=env)  # fmt: skip
    run("kubectl-snapshot", "doctor", env=env)

    say(f"a counter pod on {n1}")
    kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", show=False)
    kubectl("create", "namespace", NS, show=False)
    # what a namespace's admin allows its snapshots to be pushed to and restored from (admission checks it)
    kubectl("annotate", "namespace", NS, f"kubectl-snapshot.io/allowed-destinations={registry}/demo", show=False)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "counter", "namespace": NS},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": n1},
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "counter", "image": env["KS_BUSYBOX_IMAGE"], "command": ["sh", "-c", COUNTER]}],
        },
    }
    for _ in range(60):
        if subprocess.run(["kubectl", "get", "serviceaccount", "default", "-n", NS], env=env,
                          capture_output=True).returncode == 0:  # fmt: skip
            break
        time.sleep(1)
    subprocess.run(["kubectl", "apply", "-f", "-"], input=json.dumps(pod), text=True, env=env, check=True)
    kubectl("wait", "--for=condition=Ready", "pod/counter", "-n", NS, "--timeout=120s")
    time.sleep(5)
    before = int(kubectl("exec", "-n", NS, "counter", "-c", "counter", "--", "cat", "/tmp/count"))

    say("kubectl snapshot pod/counter: freeze, CRIU dump, push to the registry")
    ref = run("kubectl-snapshot", "pod/counter", "-n", NS, "--to", f"{registry}/demo/counter", env=env)
    run("kubectl-snapshot", "list", "-n", NS, env=env)
    run("kubectl-snapshot", "inspect", ref, env=env)

    say("the pod is deleted (its node could have died)")
    kubectl("delete", "pod", "counter", "-n", NS, "--wait=true")

    say(f"kubectl snapshot restore on {n2}")
    run("kubectl-snapshot", "restore", ref, "-n", NS, "--name", "counter", "--node", n2, env=env)
    kubectl("get", "pod", "counter", "-n", NS, "-o", "wide")
    first = int(kubectl("exec", "-n", NS, "counter", "-c", "counter", "--", "cat", "/tmp/count"))
    time.sleep(3)
    later = int(kubectl("exec", "-n", NS, "counter", "-c", "counter", "--", "cat", "/tmp/count"))
    print(f"counter: {before} just before the snapshot on {n1}; {first} right after the restore on {n2};", end=" ")
    print(f"{later} 3 s later")
    if first < before or later <= first:
        raise SystemExit("demo: the counter did not carry on from the snapshot")
    say("the counter carried on from where it was snapshotted (hack/cluster-down removes the cluster)")


def check() -> None:
    if not ENV_FILE.exists():
        raise SystemExit(f"demo --check: no cluster is up ({ENV_FILE} is missing); run make demo first")
    env = cluster_env()
    say("the demo's cluster after the test suite: nodes, the agent, doctor")
    nodes = json.loads(run("kubectl", "get", "nodes", "-o", "json", show=False, env=env))["items"]
    ready = {
        n["metadata"]["name"]
        for n in nodes
        if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
    }
    run("kubectl", "get", "nodes", env=env)
    if ready != set(env["KS_NODES"].split()):
        raise SystemExit(f"demo --check: nodes Ready {sorted(ready)}, expected {env['KS_NODES']}")
    run("kubectl", "-n", K.AGENT_NAMESPACE, "rollout", "status", f"daemonset/{K.AGENT_NAME}", "--timeout=300s",
        env=env)  # fmt: skip
    run("kubectl", "-n", K.AGENT_NAMESPACE, "wait", "--for=condition=Ready", "pod", "--all", "--timeout=300s",
        env=env)  # fmt: skip
    run("kubectl-snapshot", "doctor", env=env)  # exits 1 when anything is BAD
    say("the demo's cluster works")


if __name__ == "__main__":
    check() if sys.argv[1:] == ["--check"] else main()
