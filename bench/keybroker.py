#!/usr/bin/env python3
"""What the key broker costs a save and a restore, against the agents reading the key Secret (issue 42).

    flock /run/ks-e2e.lock .venv/bin/python -m bench.keybroker [--mib 256] [--rounds 3]

(or without flock: it then takes /run/ks-e2e.lock itself). On the local cluster (brought up if it is not
running), with the agent built from this tree: a Debian python pod holding MIB MiB of os.urandom and
counting (tests/support/lazyrestore.POD_PATTERN) runs on ks-n1. For each key mode in turn (`secret`:
the default install, every agent reads the key Secret; `broker`: `install --key-broker`, the agents ask
the broker for each key operation over TLS), in each round: a sealed save of the pod (`kubectl snapshot`,
its PodSnapshot's status.timings.totalMs, the agent's part) and its restore on ks-n2 (`kubectl snapshot
restore` to Running, eagerly), deleted before the next. The modes alternate by round (secret, broker;
then broker, secret; ...), each switch a re-install. Printed: the medians per mode and broker / secret.
The install found is put back afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.lazy_cluster import _phase, _plugin, _until, pattern_pod
from bench.recovery import cluster_up, e2e_lock
from tests.support.agent import AgentInstall, installed_agent
from tests.support.cluster import RUN_DIR, Cluster

MODES = ("secret", "broker")


def _use(cluster: Cluster, agent: AgentInstall, mode: str) -> None:
    if mode == "broker":
        from tests.e2e.test_key_broker import _install_with_broker

        _install_with_broker(cluster, agent)
    else:
        agent.reinstall()
        for node in cluster.nodes:
            agent.wait_ready(node)


def _save(cluster: Cluster, ns: str, to: str) -> tuple[dict[str, float], str]:
    t0 = time.monotonic()
    proc = _plugin(cluster, "snapshot", "pod/mem", "-n", ns, "--to", to, "-o", "json", "--timeout", "600s")
    out, err = proc.communicate(timeout=900)
    wall = time.monotonic() - t0
    if proc.returncode:
        raise AssertionError(f"the save failed: {err[-2000:]}")
    snap = json.loads(out)
    total_ms = float(((snap.get("status") or {}).get("timings") or {}).get("totalMs") or 0)
    return {"save_s": wall, "agent_save_s": total_ms / 1000}, str(snap["status"]["reference"])


def _restore(cluster: Cluster, ns: str, ref: str, name: str, mib: int) -> float:
    t0 = time.monotonic()
    proc = _plugin(cluster, "restore", ref, "-n", ns, "--name", name, "--node", cluster.nodes[1], "--timeout", "600s")
    running = _until(f"{name} Running", lambda: _phase(cluster, ns, name) == "Running", 120 + mib / 8)
    _, err = proc.communicate(timeout=600)
    if proc.returncode:
        raise AssertionError(f"kubectl snapshot restore {name} failed: {err[-2000:]}")
    cluster.kubectl("delete", "pod", name, "-n", ns, "--wait=true", timeout=180)
    return running - t0


def run(cluster: Cluster, agent: AgentInstall, mib: int, rounds: int) -> dict[str, Any]:
    ns = f"bench-keys-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    current = "secret"  # installed_agent's
    try:
        pattern_pod(cluster, ns, mib)
        for i in range(rounds):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                if mode != current:
                    _use(cluster, agent, mode)
                    current = mode
                # a repository per save: each is a first save (no page delta on an earlier one)
                row, ref = _save(cluster, ns, f"{cluster.registry}/bench/keys-{ns}-{mode}-{i}")
                row["restore_running_s"] = _restore(cluster, ns, ref, f"r{i}-{mode}", mib)
                runs[mode].append(row)
                print(json.dumps({"mib": mib, "round": i, "mode": mode, **row}), file=sys.stderr)
    finally:
        if current != "secret":
            agent.reinstall()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    keys = ("save_s", "agent_save_s", "restore_running_s")
    return {
        "mib": mib,
        "rounds": rounds,
        **{f"broker_vs_secret_{k}": round(med("broker", k) / med("secret", k), 2) for k in keys},
        "medians": {m: {k: round(med(m, k), 2) for k in keys} for m in MODES},
        "runs": runs,
    }


def report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            "| pod memory | save (plugin) broker / secret | save (agent, totalMs) | restore to Running |",
            "|---|---|---|---|",
            f"| {r['mib']} MiB | {r['broker_vs_secret_save_s']}x | {r['broker_vs_secret_agent_save_s']}x "
            f"| {r['broker_vs_secret_restore_running_s']}x |",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of memory in the pod")
    ap.add_argument("--rounds", type=int, default=3, help="saves and restores per key mode (medians)")
    ap.add_argument("--out", type=Path, help="write the result as JSON here too")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: the local cluster needs root\nhint: sudo .venv/bin/python -m bench.keybroker")
    with e2e_lock():
        cluster = cluster_up()
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp, installed_agent(cluster, Path(tmp)) as agent:
            result = run(cluster, agent, a.mib, a.rounds)
    print(report(result))
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
