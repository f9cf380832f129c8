#!/usr/bin/env python3
"""Benchmark: freeze time and checkpoint-to-pushed time of kubectl-snapshot-agent, as ratios to a raw
`criu dump` of the same workload measured in the same run.

Workload: a Python process holding N MiB of touched, incompressible memory (os.urandom), for each N in
--sizes. The agent snapshots it inside a container (real containerd, runc, CRIU, registry on loopback);
raw CRIU dumps the same program run as a plain host process, to the same filesystem. Each metric is the
median of --runs runs after one warm-up run. Absolute numbers are printed only next to their ratio.

    .venv/bin/python bench/freeze_and_push.py [--sizes 64,512] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.containerd import ContainerdDaemon
from tests.support.images import python_image
from tests.support.registry import RegistryServer

AGENT = str(Path(sys.executable).with_name("kubectl-snapshot-agent"))
WORKLOAD = (
    "import os, sys, time\n"
    "heap = bytearray(os.urandom({mib} << 20))\n"
    "open(sys.argv[1], 'w').write('ready')\n"
    "while True: time.sleep(0.05)\n"
)
STATE = Path(os.environ.get("KUBECTL_SNAPSHOT_STATE_DIR", "/var/lib/kubectl-snapshot"))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def wait_file(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"workload did not start ({path})")
        time.sleep(0.05)


def raw_criu_dump(mib: int, runs: int) -> list[float]:
    """Wall time of `criu dump --leave-running` of the workload run as a host process."""
    criu = shutil.which("criu") or "/usr/sbin/criu"
    py = shutil.which("python3", path="/usr/bin") or sys.executable
    base = STATE / "bench-raw"
    base.mkdir(parents=True, exist_ok=True)
    ready = base / "ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [py, "-c", WORKLOAD.format(mib=mib), str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    times = []
    try:
        wait_file(ready)
        for _ in range(runs + 1):
            d = Path(tempfile.mkdtemp(dir=base))
            t = time.monotonic()
            subprocess.run(
                [
                    criu,
                    "dump",
                    "-t",
                    str(proc.pid),
                    "-D",
                    str(d),
                    "--leave-running",
                    "--tcp-established",
                    "--file-locks",
                    "-o",
                    "dump.log",
                ],
                check=True,
                capture_output=True,
            )
            times.append(time.monotonic() - t)
            shutil.rmtree(d)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)
    return times[1:]


def agent_runs(daemon: ContainerdDaemon, registry: RegistryServer, mib: int, runs: int) -> list[dict[str, float]]:
    image = python_image(daemon)
    cid = f"bench-{mib}"
    c = daemon.client()
    ready_dir = Path(tempfile.mkdtemp(dir=STATE))
    mount = {"destination": "/ready", "type": "bind", "source": str(ready_dir), "options": ["rbind", "rw"]}
    c.run_container(
        cid,
        image=image,
        args=["python3", "-c", WORKLOAD.format(mib=mib), "/ready/ready"],
        mounts=[mount],
        runc_options=daemon.runc_options,
    )
    out = []
    try:
        wait_file(ready_dir / "ready")
        for i in range(runs + 1):
            t = time.monotonic()
            proc = subprocess.run(
                [
                    AGENT,
                    "checkpoint",
                    "-a",
                    daemon.address,
                    "-n",
                    daemon.namespace,
                    "-o",
                    "json",
                    "--to",
                    f"{registry.host}/bench{mib}:run{i}",
                    cid,
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            wall = time.monotonic() - t
            if proc.returncode != 0:
                raise SystemExit(f"agent checkpoint failed:\n{proc.stderr}")
            timings = json.loads(proc.stdout)["timingsMs"]
            out.append({"freeze": timings["freeze_ms"] / 1000, "pushed": wall, "size": json.loads(proc.stdout)["size"]})
    finally:
        c.remove_container(cid)
        shutil.rmtree(ready_dir, ignore_errors=True)
    return out[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,512")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="ksbench-", dir="/var/tmp"))
    daemon = ContainerdDaemon("bench", work / "ctrd")
    registry = RegistryServer(work / "registry")
    daemon.start()
    registry.start()
    rows = []
    try:
        for mib in sizes:
            raw = raw_criu_dump(mib, args.runs)
            agent = agent_runs(daemon, registry, mib, args.runs)
            raw_m = median(raw)
            freeze_m = median([a["freeze"] for a in agent])
            pushed_m = median([a["pushed"] for a in agent])
            rows.append(
                {
                    "mib": mib,
                    "raw_criu_dump_s": raw_m,
                    "freeze_s": freeze_m,
                    "freeze_ratio": freeze_m / raw_m,
                    "freeze_goal_s": 1.1 * raw_m + 0.030,
                    "freeze_meets_goal": freeze_m <= 1.1 * raw_m + 0.030,
                    "pushed_s": pushed_m,
                    "pushed_ratio": pushed_m / raw_m,
                    "snapshot_bytes": median([a["size"] for a in agent]),
                    "runs": args.runs,
                }
            )
    finally:
        daemon.stop()
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)
    facts = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()}
    print(f"machine: {facts}; medians of {args.runs} runs after 1 warm-up\n")
    print(
        "| touched memory | raw criu dump | agent freeze | freeze / raw | goal 1.1x+30ms "
        "| checkpoint->pushed | pushed / raw dump |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mib']} MiB | {r['raw_criu_dump_s'] * 1000:.0f} ms | {r['freeze_s'] * 1000:.0f} ms | "
            f"{r['freeze_ratio']:.2f}x | {'met' if r['freeze_meets_goal'] else 'missed'} | "
            f"{r['pushed_s'] * 1000:.0f} ms | {r['pushed_ratio']:.2f}x |"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": facts, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
