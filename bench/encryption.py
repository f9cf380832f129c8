#!/usr/bin/env python3
"""The cost of encryption at rest, as ratios to the same snapshot in clear measured in the same run.

    .venv/bin/python bench/encryption.py [--mib 512] [--kind random|objects] [--runs 3] [--out FILE]

One workload container (bench/workload.py); each run checkpoints it twice, in clear and sealed
(``--encrypt``), in alternating order, each to a fresh repository (everything is uploaded: the worst
case), then restores each snapshot as a new container (pull -> running), again alternating. Reports
medians of the CLI wall times and sealed/clear ratios (the goal: at most 1.10), and the same for the
agent command's CPU time (steadier than wall time on a shared VM). One warm-up run first.
Needs root and the node deps, like bench/run.py; the registry listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import AGENT, WRAPPER, container, installed_like, machine_facts, sh
from tests.support.containerd import ContainerdDaemon, node_criu_config
from tests.support.registry import RegistryServer
from tests.support.signing import signing_env


def child_cpu() -> float:
    """CPU seconds (user + system) of the waited-for children so far: the agent command's own CPU, far
    less noisy on a shared VM than its wall time (CRIU runs under containerd, not counted)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def checkpoint(daemon: ContainerdDaemon, ref: str, cid: str, seal: list[str]) -> tuple[float, float, dict[str, Any]]:
    t, cpu = time.monotonic(), child_cpu()
    addr = ["-a", daemon.address, "-n", daemon.namespace]
    proc = sh([AGENT, "checkpoint", *addr, *seal, "-o", "json", "--to", ref, cid])
    return time.monotonic() - t, child_cpu() - cpu, json.loads(proc.stdout)


def restore(daemon: ContainerdDaemon, ref: str, keys: list[str]) -> tuple[float, float, dict[str, Any]]:
    new = f"r-{uuid.uuid4().hex[:8]}"
    t, cpu = time.monotonic(), child_cpu()
    proc = sh([AGENT, "restore", "-a", daemon.address, "-n", daemon.namespace, "--runtime-binary", WRAPPER,
               "--runc-root", daemon.runc_root, *keys, "-o", "json", ref, new])  # fmt: skip
    wall, used = time.monotonic() - t, child_cpu() - cpu
    with contextlib.suppress(Exception):
        daemon.client().remove_container(new)
    return wall, used, json.loads(proc.stdout)


def measure(
    daemon: ContainerdDaemon, registry: RegistryServer, key_dir: Path, mib: int, kind: str, runs: int
) -> dict[str, Any]:
    keys = ["--key-dir", str(key_dir), "--key-namespace", "bench"]
    modes = {"clear": ([], []), "sealed": (["--encrypt", *keys], keys)}
    pushed: dict[str, list[float]] = {m: [] for m in modes}
    running: dict[str, list[float]] = {m: [] for m in modes}
    pushed_cpu: dict[str, list[float]] = {m: [] for m in modes}
    running_cpu: dict[str, list[float]] = {m: [] for m in modes}
    sizes: dict[str, int] = {}
    phases: dict[str, dict[str, list[float]]] = {m: {} for m in modes}  # the agent's own timings (ms)
    refs: dict[str, str] = {}
    with container(daemon, mib, kind) as (cid, _ctl):
        for i in range(runs + 1):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for m in order:
                ref = f"{registry.host}/enc-{m}-{uuid.uuid4().hex[:8]}:v1"
                wall, cpu, res = checkpoint(daemon, ref, cid, modes[m][0])
                refs[m], sizes[m] = res["reference"], res["size"]
                if i:
                    pushed[m].append(wall)
                    pushed_cpu[m].append(cpu)
                    for k, v in res["timingsMs"].items():
                        phases[m].setdefault("checkpoint." + k, []).append(v)
        for i in range(runs + 1):
            order = list(modes) if i % 2 == 0 else list(reversed(modes))
            for m in order:
                wall, cpu, res = restore(daemon, refs[m], modes[m][1])
                if i:
                    running[m].append(wall)
                    running_cpu[m].append(cpu)
                    for k, v in res["timingsMs"].items():
                        phases[m].setdefault("restore." + k, []).append(v)
    series = {"pushed_s": pushed, "running_s": running, "pushed_cpu_s": pushed_cpu, "running_cpu_s": running_cpu}
    med = {k: {m: statistics.median(v[m]) for m in modes} for k, v in series.items()}
    return {
        "mib": mib,
        "kind": kind,
        "runs": runs,
        "samples": series,
        "median": med,
        "ratio": {k: med[k]["sealed"] / med[k]["clear"] for k in med},
        "size_bytes": sizes,
        "phases_ms_median": {m: {k: statistics.median(v) for k, v in p.items()} for m, p in phases.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--kind", default="random", choices=["random", "objects"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    installed_like()
    os.environ.update(signing_env())  # the agent signs each snapshot and verifies it before a restore, as in use
    work = Path(tempfile.mkdtemp(prefix="ksbench-enc-", dir="/var/tmp"))
    with contextlib.ExitStack() as stack:
        stack.enter_context(node_criu_config())
        daemon = ContainerdDaemon("bench-enc", work / "ctrd")
        registry = RegistryServer(work / "registry")
        daemon.start()
        stack.callback(daemon.stop)
        registry.start()
        stack.callback(registry.stop)
        stack.callback(shutil.rmtree, work, True)
        row = measure(daemon, registry, work / "keys", a.mib, a.kind, a.runs)
    result = {"machine": machine_facts(), **row}
    text = json.dumps(result, indent=2)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    r, m = row["ratio"], row["median"]
    print(
        f"{a.kind} {a.mib} MiB, median of {a.runs}: checkpoint->pushed clear {m['pushed_s']['clear']:.2f}s "
        f"sealed {m['pushed_s']['sealed']:.2f}s (x{r['pushed_s']:.3f}); pull->running clear "
        f"{m['running_s']['clear']:.2f}s sealed {m['running_s']['sealed']:.2f}s (x{r['running_s']:.3f}); the agent "
        f"command's CPU: checkpoint x{r['pushed_cpu_s']:.3f} ({m['pushed_cpu_s']['clear']:.2f}s / "
        f"{m['pushed_cpu_s']['sealed']:.2f}s), restore x{r['running_cpu_s']:.3f} ({m['running_cpu_s']['clear']:.2f}s / "
        f"{m['running_cpu_s']['sealed']:.2f}s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
