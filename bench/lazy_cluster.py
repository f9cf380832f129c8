#!/usr/bin/env python3
"""Lazy against eager restore on the local cluster, from the registry (issue 44, item 3).

    flock /run/ks-e2e.lock .venv/bin/python -m bench.lazy_cluster [--sizes 512,2048] [--rounds 3]

(or without flock: it then takes /run/ks-e2e.lock itself). On the local cluster (brought up if it is
not running), with the agent built from this tree installed for the run, for each size S MiB: a Debian
python pod holding S MiB of os.urandom and counting (tests/support/lazyrestore.POD_PATTERN) runs on
ks-n1 and is saved once; then, in each round, it is restored on ks-n2 with `kubectl snapshot restore`,
eagerly and with `--lazy` in turn (the order alternates between rounds), each restore deleted before the
next. Measured from the restore request: the pod created (the plugin's checks and the API), Running (the
pod's phase; both read from one watch of the namespace's pods, bench/podwatch.py, as the fresh start's
Running is), the first answer (the first `kubectl exec cat /tmp/n` that reads the counter, tried every
0.25 s), and every page resident (eager: at Running; lazy: the LazyRestoreComplete Event's time, polled
every 0.25 s, so it reads up to that late).

Bounds measured in the same run: the raw download of every blob of the save (8 streams, from the host)
and a fresh pod's bound -> Running on ks-n2 (busybox, image cached), as bench/recovery.py, and to its
first answer (it writes /tmp/n as it starts, read the same way). Printed: medians over the rounds of
lazy / eager (Running, first answer), lazy Running and lazy first answer minus the fresh pod's (goal:
within 1 s), lazy resident / eager Running (goal <= 1.2x), and eager Running / (download + fresh start).
Absolute times only beside what they are divided by.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.podwatch import PhaseWatch
from bench.recovery import cluster_up, e2e_lock, fresh_pod, pull_all
from kubectl_snapshot.core import kubenames as K
from tests.support.agent import PLUGIN, installed_agent
from tests.support.cluster import RUN_DIR, Cluster
from tests.support.lazyrestore import POD_PATTERN

POLL_S = 0.25


def _plugin(cluster: Cluster, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PLUGIN, *args, "--kubeconfig", str(cluster.kubeconfig)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _until(what: str, check: Any, timeout: float) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(POLL_S)
    return time.monotonic()


def _phase(cluster: Cluster, ns: str, name: str) -> str:
    r = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "jsonpath={.status.phase}", check=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def _answers(cluster: Cluster, ns: str, name: str) -> bool:
    """The pod's app container answers: `cat /tmp/n` through `kubectl exec` reads a number."""
    r = cluster.kubectl("exec", "-n", ns, name, "-c", "app", "--", "cat", "/tmp/n", check=False, timeout=30)
    return r.returncode == 0 and r.stdout.strip().isdigit()


def _complete(cluster: Cluster, ns: str, name: str) -> bool:
    sel = f"involvedObject.name={name},reason={K.EVENT_LAZY_RESTORE_COMPLETE}"
    return bool(cluster.get_json("events", "-n", ns, "--field-selector", sel)["items"])


def restore_once(
    cluster: Cluster, watch: PhaseWatch, ns: str, ref: str, name: str, lazy: bool, mib: int
) -> dict[str, float]:
    node = cluster.nodes[1]
    t0 = time.monotonic()
    proc = _plugin(cluster, "restore", ref, "-n", ns, "--name", name, "--node", node, "--timeout", "600s",
                   *(["--lazy"] if lazy else []))  # fmt: skip
    timeout = 120 + mib / 8
    created = watch.first(name, "", timeout=timeout)
    running = watch.first(name, "Running", timeout=timeout)
    answer = _until(f"{name}'s first answer", lambda: _answers(cluster, ns, name), timeout)
    resident = _until(f"{name} resident", lambda: _complete(cluster, ns, name), timeout) if lazy else running
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"kubectl snapshot restore {name} failed: {err[-2000:]}")
    sel = f"involvedObject.name={name},reason={K.EVENT_RESTORE_STAGED}"
    staged = [str(e.get("message")) for e in cluster.get_json("events", "-n", ns, "--field-selector", sel)["items"]]
    print(json.dumps({"pod": name, "staged": staged}), file=sys.stderr)  # where the node's staging time went
    cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=true", timeout=180)
    return {"created_s": created - t0, "running_s": running - t0, "answer_s": answer - t0, "resident_s": resident - t0}


def fresh_start(cluster: Cluster, watch: PhaseWatch, ns: str, node: str) -> tuple[float, float]:
    """Seconds from `kubectl apply` of a plain busybox pod bound to `node` to the watch showing it Running,
    and to its first answer (it writes /tmp/n as it starts; read as the restored pods' are), the second of
    two (the first makes sure the image is cached there), timed as the restores are."""
    took = (0.0, 0.0)
    for i in range(2):
        name = f"fresh-{i}"
        body = fresh_pod(cluster, ns, name, node)
        body["spec"]["containers"][0].update(name="app", command=["sh", "-c", "echo 0 > /tmp/n; exec sleep 3600"])
        t0 = time.monotonic()
        cluster.apply(body)
        running = watch.first(name, "Running", timeout=180) - t0
        took = (running, _until(f"{name}'s first answer", lambda n=name: _answers(cluster, ns, n), 180) - t0)
        cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=false")
    return took


def pattern_pod(cluster: Cluster, ns: str, mib: int) -> None:
    """Pod `mem` on the first node: a Debian python process holding `mib` MiB of random bytes and counting;
    returns once it counts."""
    from tests.e2e.test_whole_pod import _push_python_image

    command = ["python3", "-c", POD_PATTERN, str(mib << 20)]
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "mem", "namespace": ns},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": cluster.nodes[0]},
            "containers": [{"name": "app", "image": _push_python_image(cluster), "command": command}],
            "terminationGracePeriodSeconds": 1,
        },
    }
    cluster.apply(body)
    _until("mem counting", lambda: _phase(cluster, ns, "mem") == "Running" and _answers(cluster, ns, "mem"), 300)


def one(cluster: Cluster, mib: int, rounds: int) -> dict[str, Any]:
    ns = f"bench-lazy-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        pattern_pod(cluster, ns, mib)
        save = _plugin(cluster, "snapshot", "pod/mem", "-n", ns, "--to", f"{cluster.registry}/bench/lazy-{ns}",
                       "-o", "json", "--timeout", "600s")  # fmt: skip
        out, err = save.communicate(timeout=900)
        if save.returncode:
            raise AssertionError(f"the save failed: {err[-2000:]}")
        ref = str(json.loads(out)["status"]["reference"])
        download_s, pulled = pull_all(ref)
        runs: dict[str, list[dict[str, float]]] = {"eager": [], "lazy": []}
        with PhaseWatch(cluster, ns) as watch:
            fresh_s, fresh_answer_s = fresh_start(cluster, watch, ns, cluster.nodes[1])
            for i in range(rounds):
                order = ("eager", "lazy") if i % 2 == 0 else ("lazy", "eager")
                for mode in order:
                    runs[mode].append(restore_once(cluster, watch, ns, ref, f"r{i}-{mode}", mode == "lazy", mib))
                    print(json.dumps({"mib": mib, "round": i, "mode": mode, **runs[mode][-1]}), file=sys.stderr)

        def med(mode: str, key: str) -> float:
            return statistics.median(r[key] for r in runs[mode])

        return {
            "mib": mib,
            "rounds": rounds,
            "pulled_bytes": pulled,
            "lazy_vs_eager_running": round(med("lazy", "running_s") / med("eager", "running_s"), 2),
            "lazy_vs_eager_answer": round(med("lazy", "answer_s") / med("eager", "answer_s"), 2),
            "lazy_running_minus_fresh_s": round(med("lazy", "running_s") - fresh_s, 2),
            "lazy_answer_minus_fresh_s": round(med("lazy", "answer_s") - fresh_answer_s, 2),
            "fresh_answer_s": round(fresh_answer_s, 2),
            # the same from the pod's creation: the node's part (the plugin's checks and the API before it)
            "lazy_created_to_running_minus_fresh_s": round(
                statistics.median(r["running_s"] - r["created_s"] for r in runs["lazy"]) - fresh_s, 2
            ),
            "fresh_start_s": round(fresh_s, 2),
            "lazy_resident_vs_eager_running": round(med("lazy", "resident_s") / med("eager", "running_s"), 2),
            "eager_running_vs_bound": round(med("eager", "running_s") / (download_s + fresh_s), 2),
            "runs": runs,
        }
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def report(rows: list[dict[str, Any]]) -> str:
    out = [
        "| pod memory | lazy / eager: Running | first answer | lazy Running - fresh start (goal <= 1 s) "
        "| lazy first answer - fresh pod's (goal <= 1 s) | the same from the pod's creation "
        "| lazy resident / eager Running (goal <= 1.2x) | eager Running / (download + fresh start) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['mib']} MiB | {r['lazy_vs_eager_running']}x | {r['lazy_vs_eager_answer']}x "
            f"| {r['lazy_running_minus_fresh_s']} s (of a {r['fresh_start_s']} s fresh start) "
            f"| {r['lazy_answer_minus_fresh_s']} s (of {r['fresh_answer_s']} s) "
            f"| {r['lazy_created_to_running_minus_fresh_s']} s "
            f"| {r['lazy_resident_vs_eager_running']}x | {r['eager_running_vs_bound']}x |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512", help="MiB of memory per pod, comma-separated (e.g. 512,2048)")
    ap.add_argument("--rounds", type=int, default=3, help="eager and lazy restores per size (medians)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here too")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: the local cluster needs root\nhint: sudo .venv/bin/python -m bench.lazy_cluster")
    rows = []
    # The plugin and the node's Python processes start from bytecode, as installed (krew/package.py ships
    # it): with PYTHONDONTWRITEBYTECODE set, or a tree never imported, each start compiled its modules
    # again (about 0.2 s of the plugin's start here), which no user's restore pays.
    for tree in ("kubectl_snapshot", "shim"):
        compileall.compile_dir(str(Path(__file__).resolve().parent.parent / tree), quiet=1)
    with e2e_lock():
        cluster = cluster_up()
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp, installed_agent(cluster, Path(tmp)):
            for mib in (int(s) for s in a.sizes.split(",")):
                rows.append(one(cluster, mib, a.rounds))
    print(report(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
