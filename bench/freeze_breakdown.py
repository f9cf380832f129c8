#!/usr/bin/env python3
"""Where the freeze goes: the steps of the agent's freeze for one container, timed separately in one
run, next to a raw `criu dump` of the same program as a host process and the cgroup freezer itself.

    sudo .venv/bin/python bench/freeze_breakdown.py [--mib 64] [--runs 5]

Prints medians (after one warm-up) and each step's ratio to the raw CRIU dump.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.containerd import ContainerdDaemon
from tests.support.images import python_image

PROGRAM = "import os, time\nheap = bytearray(os.urandom({mib} << 20))\nwhile True: time.sleep(0.05)\n"


def timed(fn: Callable[[], object]) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def raw_criu(mib: int, runs: int, work: Path) -> list[float]:
    py = "/usr/bin/python3"
    proc = subprocess.Popen(
        [py, "-c", PROGRAM.format(mib=mib)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(3)
    out = []
    try:
        for i in range(runs + 1):
            d = work / f"raw{i}"
            d.mkdir()
            cmd = ["criu", "dump", "-t", str(proc.pid), "-D", str(d), "--leave-running", "-o", "dump.log"]
            out.append(timed(lambda cmd=cmd: subprocess.run(cmd, check=True, capture_output=True)))
            shutil.rmtree(d)
    finally:
        proc.kill()
        proc.wait()
    return out[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ksfreeze-", dir="/var/tmp"))
    daemon = ContainerdDaemon("freeze", work / "ctrd")
    daemon.start()
    steps: dict[str, list[float]] = {"pause (containerd RPC)": [], "checkpoint (runc + CRIU)": [], "resume": []}
    steps["cgroup freezer write"] = []
    try:
        c = daemon.client()
        c.run_container(
            "w",
            image=python_image(daemon),
            args=["python3", "-c", PROGRAM.format(mib=args.mib)],
            runc_options=daemon.runc_options,
        )
        time.sleep(4)
        state = f"/sys/fs/cgroup/freezer{c.get_container('w').spec['linux']['cgroupsPath']}/freezer.state"
        for i in range(args.runs + 1):
            d = work / f"img{i}"
            d.mkdir()
            steps["pause (containerd RPC)"].append(timed(lambda: c.pause_task("w")))
            steps["checkpoint (runc + CRIU)"].append(
                timed(lambda d=d: c.checkpoint_task("w", image_path=str(d), work_path=str(d)))
            )
            steps["resume"].append(timed(lambda: c.resume_task("w")))
            shutil.rmtree(d)
            if os.path.exists(state):
                steps["cgroup freezer write"].append(timed(lambda: Path(state).write_text("FROZEN")))
                Path(state).write_text("THAWED")
        raw = statistics.median(raw_criu(args.mib, args.runs, work))
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.mib} MiB touched, medians of {args.runs} runs after a warm-up; raw criu dump: {raw * 1000:.0f} ms\n")
    print("| step | median | / raw criu dump |\n|---|---|---|")
    for name, xs in steps.items():
        if xs[1:]:
            m = statistics.median(xs[1:])
            print(f"| {name} | {m * 1000:.1f} ms | {m / raw:.2f}x |")


if __name__ == "__main__":
    main()
