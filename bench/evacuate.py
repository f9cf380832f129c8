#!/usr/bin/env python3
"""Evacuating a node within its notice: N protected pods drained at once, serial against parallel saves (issue 43).

    flock /run/ks-e2e.lock .venv/bin/python -m bench.evacuate [--pods 8] [--mib 32] [--dirty 0.5] [--grace 30]

(or without flock: it then takes /run/ks-e2e.lock itself). On the local cluster (brought up if it is not
running, and taken down again afterwards), with the agent built from this tree installed for the run:

- a StatefulSet of --pods pods on ks-n1, each holding --mib MiB of incompressible memory and counting
  in memory; one SnapshotPolicy (--interval, 60 s: a pod's first save comes within a minute of its
  start, maybe before its memory is filled, so the drain waits for one taken after);
- once every pod has a periodic save of its filled memory, each rewrites the --dirty fraction of it
  once, and then ``kubectl drain ks-n1`` (the pods' own --grace period, the notice) evicts them all at
  once; the script follows their final saves (polled every 0.25 s) and their replacements on ks-n2;
- once per mode (--modes): ``serial``, ks-n1's agent at ``--save-concurrency 1`` (the saves of a node one
  after another, as before issue 43); ``parallel``, its defaults; ``parallel-dumps2``, the defaults with
  ``--dump-concurrency 2``.

Printed for each mode: the evacuation time (drain start -> the last final save seen pushed) against its
bound, the bytes the final saves must send at the throughput the same node measured for one large save
in the same run (a pod of the pods' dirty memory in all, saved alone), and the pods that lost work (no
pushed final save, or a replacement that did not carry on from the counter's value at the drain), with
where the time went; then each mode's ratio to serial's evacuation time. Absolute times are shown only
next to their bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cpushare
from bench.recovery import e2e_lock
from kubectl_snapshot.adapters.kube import KubeClient
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from tests.support import node_loss
from tests.support.agent import AgentInstall, installed_agent
from tests.support.cluster import HACK, RUN_DIR, STATE_DIR, Cluster, _cluster_lock, _load, _running
from tests.support.node_loss import POLL_S, protect

# ks-n1's agent settings per mode (its node map entry; the rest at their defaults)
MODES: dict[str, dict[str, str]] = {
    "serial": {"save_concurrency": "1"},  # one save at a time, as before issue 43
    "parallel": {},  # the defaults: --save-concurrency one per CPU (at least 2), --dump-concurrency 1
    "parallel-dumps2": {"dump_concurrency": "2"},  # two freezes and dumps at once
}
GOAL = 1.3  # evacuation time / bound (issue 43)
APP = "evac"
MARK = "bench-evacuate"
REWRITE = "/tmp/rewrite"  # a pod rewrites its dirty part once when this file appears, then removes it
PROBE_MAX_MIB = 512  # the throughput probe's memory, at most

# Holds CLEAN bytes (base64 of random: incompressible enough) for good and DIRTY bytes it rewrites when
# told (REWRITE), and counts in memory (a fresh start draws a new token), once a second: each count
# forks the shell twice (mv, sleep), and at 5 a second 30 pods' counting took about a third of this
# machine's CPU from the saves it measures (docs/node-loss.md, "Where the time and the CPU go").
WORKLOAD = (
    "hold=$(head -c {clean} /dev/urandom | base64 -w0); d=$(head -c {dirty} /dev/urandom | base64 -w0); "
    "tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    "while true; do "
    f"if [ -f {REWRITE} ]; then d=$(head -c {{dirty}} /dev/urandom | base64 -w0); rm -f {REWRITE}; fi; "
    'i=$((i+1)); echo "$tok $i" > /tmp/count.t; mv /tmp/count.t /tmp/count; sleep 1; done'
)


@contextlib.contextmanager
def local_cluster() -> Iterator[Cluster]:
    """The running local cluster, or one brought up for the run and taken down after it."""
    with _cluster_lock() as env:
        found = _running()
        if found is None:
            up = subprocess.run([str(HACK / "up.sh")], capture_output=True, text=True, timeout=3600, env=env)
            if up.returncode != 0:
                sys.exit(f"error: hack/cluster/up.sh failed ({up.returncode}):\n{up.stderr[-3000:]}")
    try:
        yield found or _load(STATE_DIR / "cluster.env")
    finally:
        if found is None:
            with _cluster_lock() as env:
                subprocess.run([str(HACK / "down.sh")], capture_output=True, text=True, timeout=600, env=env)


def command(mib: float, dirty: float) -> str:
    """The pod's shell: base64 makes 4 bytes of 3, so 3/4 of each part is read from /dev/urandom."""
    clean_b, dirty_b = int(mib * (1 - dirty) * 2**20), int(mib * dirty * 2**20)
    return WORKLOAD.format(clean=clean_b * 3 // 4, dirty=dirty_b * 3 // 4)


def statefulset(ns: str, image: str, node: str, *, pods: int, mib: float, dirty: float, grace: int) -> dict[str, Any]:
    prefer = {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
    container = {"name": "counter", "image": image, "command": ["sh", "-c", command(mib, dirty)]}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": APP, "namespace": ns},
        "spec": {
            "replicas": pods,
            "serviceName": APP,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": APP}},
            "template": {
                "metadata": {"labels": {"app": APP, MARK: ns}},
                "spec": {
                    "containers": [container],
                    "terminationGracePeriodSeconds": grace,
                    "affinity": {
                        "nodeAffinity": {
                            "preferredDuringSchedulingIgnoredDuringExecution": [
                                {"weight": 100, "preference": {"matchExpressions": [prefer]}}
                            ]
                        }
                    },
                },
            },
        },
    }


def pod_json(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    got = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(got.stdout) if got.returncode == 0 else None


def running(cluster: Cluster, ns: str, name: str, *, not_uid: str = "", timeout: float = 300) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def ok() -> bool:
        p = pod_json(cluster, ns, name)
        if p is None or p["metadata"]["uid"] == not_uid or p["metadata"].get("deletionTimestamp"):
            return False
        found.update(p)
        return bool(p.get("status", {}).get("phase") == "Running")

    cluster.wait_for(f"{ns}/{name} running", ok, timeout)
    return found


def counter(cluster: Cluster, ns: str, name: str) -> tuple[str, int] | None:
    got = cluster.kubectl("exec", "-n", ns, name, "--", "cat", "/tmp/count", check=False, timeout=30)
    parts = got.stdout.split()
    return (parts[0], int(parts[1])) if got.returncode == 0 and len(parts) == 2 else None


_clients: dict[str, KubeClient] = {}


def saves(cluster: Cluster, ns: str, selector: str) -> list[dict[str, Any]]:
    """The PodSnapshots of `ns` that `selector` selects, through one client kept for the run: polled every
    0.25 s during the drain, a kubectl process each time cost the machine the bench measures a tenth of
    its CPU (its `cpu_s`: "the bench and its kubectl")."""
    client = _clients.get(str(cluster.kubeconfig))
    if client is None:
        client = _clients[str(cluster.kubeconfig)] = KubeClient.from_config(str(cluster.kubeconfig))
    return client.list_snapshots(ns, label_selector=selector)


def phase(s: dict[str, Any]) -> str:
    return str((s.get("status") or {}).get("phase") or "")


def probe_throughput(cluster: Cluster, ns: str, mib: float) -> tuple[float, int]:
    """Bytes per second of one large save on ks-n1: the first (full) periodic save of a pod of `mib` MiB,
    alone on the node, its compressed size over its time from claim to push. The policy comes once the
    pod's memory is filled (it counts from then on), so that its first save holds all of it."""
    cluster.apply(node_loss.statefulset("probe", ns, cluster.busybox_image, mib=int(mib), prefer=cluster.nodes[0]))
    running(cluster, ns, "probe-0")
    cluster.wait_for("the probe's memory filled", lambda: counter(cluster, ns, "probe-0") is not None, 300)
    protect(cluster, ns, "probe", 600)
    cluster.wait_for("the probe's save", lambda: bool(node_loss.good_saves(cluster, ns, "probe")), 600)
    st = node_loss.good_saves(cluster, ns, "probe")[0]["status"]
    return int(st["size"]) / (float(st["timings"]["totalMs"]) / 1000), int(st["size"])


def one(cluster: Cluster, agent: AgentInstall, mode: str, a: argparse.Namespace, throughput: float) -> dict[str, Any]:
    n1, n2 = cluster.nodes[:2]
    ns = f"bench-evac-{mode}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    override = MODES[mode]
    ctx = agent.node_override(n1, **override) if override else contextlib.nullcontext()
    try:
        with ctx:
            protect(cluster, ns, APP, a.interval)
            sts = statefulset(ns, cluster.busybox_image, n1, pods=a.pods, mib=a.mib, dirty=a.dirty, grace=a.grace)
            names = [f"{APP}-{i}" for i in range(a.pods)]
            # the pods prefer n1 (their replacements must be free to go to n2), and the scheduler's default
            # spreading of a StatefulSet's pods outweighs a preference from about 10 pods on: n2 is
            # cordoned while they are placed
            cluster.kubectl("cordon", n2)
            try:
                cluster.apply(sts)
                old = {n: running(cluster, ns, n) for n in names}
            finally:
                cluster.kubectl("uncordon", n2, check=False)
            elsewhere = [n for n, p in old.items() if p["spec"]["nodeName"] != n1]
            if elsewhere:
                sys.exit(f"error: {', '.join(elsewhere)} did not go to {n1}: the node lacks room for {a.pods} pods")

            # a pod's first save comes within a minute of its start (at its own offset), maybe before its
            # memory is filled: the drain waits for a periodic save of each pod taken after it was filled,
            # as a node's notice finds them
            for n in names:

                def is_filled(n: str = n) -> bool:
                    return counter(cluster, ns, n) is not None

                cluster.wait_for(f"{n}'s memory filled", is_filled, 300)
            filled = time.time()

            def periodic_done() -> bool:
                good = {
                    (s["metadata"].get("labels") or {}).get(K.LABEL_POD_UID)
                    for s in saves(cluster, ns, K.LABEL_POLICY)
                    if phase(s) == K.PHASE_SUCCEEDED and (T.seconds(s["metadata"]["creationTimestamp"]) or 0) > filled
                }
                return all(p["metadata"]["uid"] in good for p in old.values())

            cluster.wait_for("every pod's periodic save", periodic_done, a.interval + 60 + 30 * a.pods)
            # every pod's dirty part rewritten once since its periodic save, then the notice
            for n in names:
                cluster.kubectl("exec", "-n", ns, n, "--", "touch", REWRITE)

            def rewritten() -> bool:
                return all(
                    cluster.kubectl("exec", "-n", ns, n, "--", "test", "-e", REWRITE, check=False).returncode == 1
                    for n in names
                )

            cluster.wait_for("every pod's dirty part rewritten", rewritten, 120)
            before = {n: counter(cluster, ns, n) for n in names}
            cpu0 = cpushare.sample()
            t0 = time.time()
            drain = subprocess.Popen(
                [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "drain", n1,
                 "--ignore-daemonsets", "--delete-emptydir-data", f"--pod-selector={MARK}={ns}",
                 f"--timeout={a.grace + 120}s"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            seen: dict[str, tuple[str, float]] = {}  # final save -> (its terminal phase, when first seen)
            while len(seen) < a.pods and time.time() - t0 < a.grace + 120:
                for s in saves(cluster, ns, f"{K.LABEL_FINAL_SAVE}=true"):
                    name = s["metadata"]["name"]
                    if name not in seen and phase(s) in K.TERMINAL_PHASES:
                        seen[name] = (phase(s), time.time() - t0)
                time.sleep(POLL_S)
            cpu = cpushare.shares(cpu0, cpushare.sample())  # drain start -> every final save seen ended
            cpu_window = time.time() - t0
            _, err = drain.communicate(timeout=a.grace + 180)
            finals = saves(cluster, ns, f"{K.LABEL_FINAL_SAVE}=true")
            pushed = [t for p, t in seen.values() if p == K.PHASE_SUCCEEDED]
            created = [T.seconds(s["metadata"]["creationTimestamp"]) or t0 for s in finals]
            timings = [(s.get("status") or {}).get("timings") or {} for s in finals if phase(s) == K.PHASE_SUCCEEDED]
            totals = [float(t.get("totalMs") or 0) / 1000 for t in timings]
            lost = []
            for n in names:
                new = running(cluster, ns, n, not_uid=old[n]["metadata"]["uid"])
                after = counter(cluster, ns, n)
                was = before[n]
                if new["spec"]["nodeName"] != n2 or not after or not was or after[0] != was[0] or after[1] < was[1]:
                    lost.append(n)
            bytes_sent = sum(
                int((s.get("status") or {}).get("size") or 0) for s in finals if phase(s) == K.PHASE_SUCCEEDED
            )
            failed = [(s.get("status") or {}).get("message") for s in finals if phase(s) == K.PHASE_FAILED]
    finally:
        cluster.kubectl("uncordon", n1, check=False)
        cluster.kubectl("uncordon", n2, check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    evacuation = max(pushed) if pushed else float("nan")
    # the bound: the pods' dirty memory (what an incremental final save sends), compressed as the
    # probe's was, at the probe's throughput; the final saves' own sizes count every blob of each
    dirty_bytes = a.pods * a.mib * a.dirty * 2**20
    return {
        "mode": mode,
        "pods": a.pods,
        "final_saves": len(finals),
        "pushed": len(pushed),
        "evacuation_s": round(evacuation, 2),
        "dirty_bytes": int(dirty_bytes),
        "final_sizes": bytes_sent,
        "lost": lost,
        "failed": failed,
        "drain_rc": drain.returncode,
        "drain_err": err[-500:] if drain.returncode else "",
        "throughput": throughput,
        # where the time went: drain start -> the first final save created (1 s resolution), and the
        # final saves' own times from claim to push (their timings.totalMs), summed and the longest
        "first_created_s": round(min(created) - t0, 1) if created else None,
        "save_total_s": round(sum(totals), 2),
        "save_max_s": round(max(totals, default=0.0), 2),
        # where one final save's time goes: the median of each part (status.timings), and what the parts
        # leave out of the total (the dump gate's wait, the volumes, the config)
        "final_median_ms": _medians(timings),
        # the CPU seconds each component of the cluster used from the drain to the last final save seen
        "cpu_s": cpu,
        "cpu_window_s": round(cpu_window, 2),
    }


PARTS = ("preflightMs", "freezeMs", "packageMs", "uploadMs", "stopMs")


def _medians(timings: list[dict[str, Any]]) -> dict[str, float]:
    if not timings:
        return {}
    rows = [{**t, "otherMs": float(t.get("totalMs") or 0) - sum(float(t.get(k) or 0) for k in PARTS)} for t in timings]
    return {k: round(statistics.median(float(r.get(k) or 0) for r in rows), 1) for k in (*PARTS, "otherMs", "totalMs")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--mib", type=float, default=32, help="MiB of memory per pod")
    ap.add_argument("--dirty", type=float, default=0.5, help="the fraction of it rewritten since the last save")
    ap.add_argument("--grace", type=int, default=30, help="the pods' terminationGracePeriodSeconds (the notice)")
    ap.add_argument("--interval", type=int, default=60, help="the policy's interval: the drain follows its 2nd save")
    ap.add_argument("--modes", default="serial,parallel", help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    a = ap.parse_args()
    unknown = [m for m in a.modes.split(",") if m not in MODES]
    if unknown:
        sys.exit(f"error: unknown mode(s) {', '.join(unknown)}\nhint: --modes takes {', '.join(MODES)}")
    if os.geteuid() != 0:
        sys.exit("error: the local cluster needs root\nhint: sudo .venv/bin/python -m bench.evacuate")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("error: terminated"))
    rows = []
    with e2e_lock(), local_cluster() as cluster:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp, installed_agent(cluster, Path(tmp)) as agent:
            ns = f"bench-evac-probe-{uuid.uuid4().hex[:6]}"
            cluster.kubectl("create", "namespace", ns)
            try:
                probe_mib = min(PROBE_MAX_MIB, max(16.0, a.pods * a.mib * a.dirty))
                throughput, probe_size = probe_throughput(cluster, ns, probe_mib)
            finally:
                cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
            ratio = probe_size / (probe_mib * 2**20)  # compressed bytes per byte of memory
            for mode in a.modes.split(","):
                row = one(cluster, agent, mode, a, throughput)
                row["bound_s"] = round(row["dirty_bytes"] * ratio / throughput, 2)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    print(report(rows, a))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2) + "\n")


def report(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    out = [
        f"{a.pods} pods x {a.mib:g} MiB, {a.dirty:.0%} rewritten since the last save, grace period {a.grace} s:",
        f"| saves | evacuation vs bound (goal <= {GOAL}x) | final saves pushed | pods that lost work"
        " | drain -> first final save created | final saves in the engine (dump-gate wait included), summed |",
        "|---|---|---|---|---|---|",
    ]
    by = {r["mode"]: r for r in rows}
    for r in rows:
        out.append(
            f"| {r['mode']} | {r['evacuation_s'] / r['bound_s']:.2f}x"
            f" ({r['evacuation_s']:.1f} s / {r['bound_s']:.1f} s)"
            f" | {r['pushed']}/{r['pods']} | {len(r['lost'])}/{r['pods']}"
            f" | {r['first_created_s']} s | {r['save_total_s']:.1f} s, longest {r['save_max_s']:.1f} s |"
        )
    for r in rows:
        if r.get("final_median_ms"):
            parts = ", ".join(f"{k.removesuffix('Ms')} {v:.0f}" for k, v in r["final_median_ms"].items())
            out.append(f"\n{r['mode']}: a final save's parts, median ms: {parts}")
        if r.get("cpu_s"):
            window = (os.cpu_count() or 1) * r["cpu_window_s"]
            cpu = ", ".join(f"{k} {v / window:.0%}" for k, v in r["cpu_s"].items())
            out.append(f"{r['mode']}: the CPU from the drain until every final save ended ({window:.0f} CPU-s): {cpu}")
    for mode in (m for m in by if m != "serial" and "serial" in by):
        out.append(f"\n{mode} / serial evacuation time: {by[mode]['evacuation_s'] / by['serial']['evacuation_s']:.2f}x")
    out.append(
        "The bound: the pods' rewritten memory, compressed as the throughput probe's save was, at the throughput"
        " ks-n1 measured for that one large save (alone) in the same run."
    )
    return "\n".join(out)


if __name__ == "__main__":
    main()
