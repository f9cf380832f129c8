#!/usr/bin/env python3
"""Where the freeze goes: the steps of the agent's freeze for one container, timed separately in one
run, next to a raw `criu dump` of the same program as a host process and the cgroup freezer itself.
The checkpoint is timed twice, alternating: with CRIU's defaults and with the runc CRIU configuration
install-node writes (shim/criu_config.py: nftables network lock); CRIU's own start-up before it
seizes the task (read off dump.log) is shown on its own.

    sudo .venv/bin/python bench/freeze_breakdown.py [--mib 64] [--runs 5]

Prints medians (after one warm-up) and each step's ratio to the raw CRIU dump.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shim import criu_config
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


def criu_startup(log: str) -> float | None:
    """Seconds from CRIU's start to its seizing the first task, from dump.log's timestamps."""
    for line in log.splitlines():
        m = re.match(r"\((\d+\.\d+)\) (freezing cgroup|SEIZE )", line)
        if m:
            return float(m.group(1))
    return None


def log_gaps(log: str, n: int) -> list[tuple[float, str, str]]:
    """The `n` longest pauses between consecutive dump.log lines: (seconds, line before, line after)."""
    stamped = [
        (float(m.group(1)), line.strip()) for line in log.splitlines() if (m := re.match(r"\((\d+\.\d+)\)", line))
    ]
    gaps = [(b[0] - a[0], a[1][:90], b[1][:90]) for a, b in itertools.pairwise(stamped)]
    return sorted(gaps, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gaps", type=int, default=8, help="list the N longest pauses in one dump.log (node config)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ksfreeze-", dir="/var/tmp"))
    daemon = ContainerdDaemon("freeze", work / "ctrd")
    daemon.start()
    last_log = ""
    default, tuned = "checkpoint, CRIU defaults (iptables lock)", "checkpoint, node config (nftables lock)"
    startup = "  of which CRIU start-up before it seizes the task"
    direct = "`runc checkpoint --leave-running` on the same container, node config (no containerd, no pause)"
    pause, resume = "containerd Pause (the agent's fallback)", "containerd Resume (the agent's fallback)"
    write = "cgroup freezer write (what the agent does)"
    steps: dict[str, list[float]] = {pause: [], default: [], tuned: [], startup: [], resume: []}
    steps[direct] = []
    steps[write] = []
    before = criu_config.remove()
    if before.state == "foreign":
        sys.exit(f"{criu_config.RUNC_CONF} was not written by kubectl-snapshot: not comparing configurations")
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
        for i in range(2 * (args.runs + 1)):
            variant = tuned if i % 2 else default
            if variant == tuned:
                criu_config.ensure()
            d = work / f"img{i}"
            d.mkdir()
            steps[pause].append(timed(lambda: c.pause_task("w")))
            steps[variant].append(timed(lambda d=d: c.checkpoint_task("w", image_path=str(d), work_path=str(d))))
            steps[resume].append(timed(lambda: c.resume_task("w")))
            up = criu_startup((d / "dump.log").read_text(errors="replace"))
            if variant == tuned and up is not None:
                steps[startup].append(up)
            if variant == tuned:
                last_log = (d / "dump.log").read_text(errors="replace")
            if variant == tuned:
                r = work / f"runc{i}"
                r.mkdir()
                runc = ["runc", "--root", str(next(Path(daemon.runc_root).iterdir())), "checkpoint", "--leave-running"]
                cmd = [*runc, "--tcp-established", "--image-path", str(r), "--work-path", str(r), "w"]
                steps[direct].append(timed(lambda cmd=cmd: subprocess.run(cmd, check=True, capture_output=True)))
                shutil.rmtree(r)
            criu_config.remove()
            shutil.rmtree(d)
            if os.path.exists(state):
                steps[write].append(timed(lambda: Path(state).write_text("FROZEN")))
                Path(state).write_text("THAWED")
        raw = statistics.median(raw_criu(args.mib, args.runs, work))
    finally:
        criu_config.remove()
        if before.state == "removed":  # install-node had written it: leave the node as it was
            criu_config.ensure()
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.mib} MiB touched, medians of {args.runs} runs after a warm-up; raw criu dump: {raw * 1000:.0f} ms\n")
    print("| step | median | / raw criu dump |\n|---|---|---|")
    for name, xs in steps.items():
        if xs[1:]:
            m = statistics.median(xs[1:])
            print(f"| {name} | {m * 1000:.1f} ms | {m / raw:.2f}x |")
    if args.gaps and last_log:
        print(f"\nThe {args.gaps} longest pauses between lines of the last dump.log (node config): where CRIU spends")
        print("its time beyond copying pages (a line is logged, then nothing until the next one).\n")
        print("| pause | last line before it | first line after it |\n|---|---|---|")
        for sec, before, after in log_gaps(last_log, args.gaps):
            print(f"| {sec * 1000:.1f} ms | `{before}` | `{after}` |")


if __name__ == "__main__":
    main()
