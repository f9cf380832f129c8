"""Where a dump is written: a raw CRIU dump of the same host process to the disk and to a tmpfs, alternated.

    sudo flock /run/ks-e2e.lock .venv/bin/python bench/dump_target.py [--mib 512] [--kind objects] [--runs 5]

The bench workload (bench/workload.py) runs as a host process; each round dumps it with
``criu dump --leave-running`` into a fresh directory under ``--disk`` (default /var/tmp) and under
``--tmpfs`` (default /dev/shm), in turns, and removes each dump right after it, as the agent removes
its work directory after every snapshot. Prints every run's time and the medians: what the agent's
memory work area (shim/host/memwork.py) takes out of the freeze, on this machine's disk.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workload import args as workload_args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--kind", choices=("random", "objects"), default="objects")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--disk", default="/var/tmp")
    p.add_argument("--tmpfs", default="/dev/shm")
    a = p.parse_args()
    ctl = Path(tempfile.mkdtemp(prefix="ks-dump-target-"))
    proc = subprocess.Popen(
        ["python3", *workload_args(ctl, a.mib, a.kind)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    times: dict[str, list[float]] = {"disk": [], "tmpfs": []}
    try:
        while not (ctl / "ready").exists():
            if proc.poll() is not None:
                sys.exit("the workload exited")
            time.sleep(0.05)
        for i in range(a.runs):
            order = [("disk", a.disk), ("tmpfs", a.tmpfs)]
            for where, base in order if i % 2 == 0 else order[::-1]:
                d = Path(tempfile.mkdtemp(prefix="ks-dump-target-", dir=base))
                try:
                    t = time.perf_counter()
                    subprocess.run(
                        ["criu", "dump", "-t", str(proc.pid), "-D", str(d), "--leave-running", "-o", "dump.log"],
                        check=True,
                    )
                    times[where].append((time.perf_counter() - t) * 1000)
                finally:
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(ctl, ignore_errors=True)
    print(f"raw criu dump of a {a.mib} MiB {a.kind} host process, {a.runs} runs each, alternated:")
    for where, base in (("disk", a.disk), ("tmpfs", a.tmpfs)):
        runs = ", ".join(f"{x:.0f}" for x in times[where])
        print(f"  {where} ({base}): median {statistics.median(times[where]):.0f} ms; runs {runs} ms")
    ratio = statistics.median(times["tmpfs"]) / statistics.median(times["disk"])
    print(f"  tmpfs / disk: {ratio:.2f}x")


if __name__ == "__main__":
    main()
