#!/usr/bin/env python3
"""Where a dump is written, and what CRIU pays for it: one run, the three places alternated.

    sudo flock /run/ks-e2e.lock .venv/bin/python bench/dump_targets.py [--sizes 64,512] [--kinds objects]
                                                                      [--runs 7]

For each workload (bench/workload.py, a host process), a raw ``criu dump --leave-running`` into:

* ``/dev/shm``: the host's tmpfs, 4 KiB pages (where the memory work area was before session 25);
* a tmpfs mounted with ``huge=within_size`` (what install-node mounts for the memory work area,
  shim/host/workfs.py, with its options);
* the state dir's file system (``KUBECTL_SNAPSHOT_STATE_DIR``, else /var/lib/kubectl-snapshot: its
  page cache);

round after round in that order, after one warm-up round; then removing the dump (what the agent's
reaper does after the answer). Prints medians and each place's ratio to ``/dev/shm``.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.autosave_cost import host_workload
from shim.host import workfs

CRIU = shutil.which("criu") or "/usr/sbin/criu"


def measure(mib: int, kind: str, runs: int, targets: dict[str, str]) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in targets}
    with host_workload(Path(tempfile.gettempdir()), mib, kind) as pid:
        for i in range(runs + 1):
            for name, base in targets.items():
                d = tempfile.mkdtemp(dir=base)
                t = time.monotonic()
                subprocess.run([CRIU, "dump", "-t", str(pid), "-D", d, "--leave-running", "--tcp-established",
                                "--file-locks", "-o", "dump.log"], check=True)  # fmt: skip
                dump = time.monotonic() - t
                t = time.monotonic()
                shutil.rmtree(d)
                removed = time.monotonic() - t
                if i:
                    out[name][0].append(dump * 1000)
                    out[name][1].append(removed * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,512")
    ap.add_argument("--kinds", default="objects")
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    state = os.environ.get("KUBECTL_SNAPSHOT_STATE_DIR", "/var/lib/kubectl-snapshot")
    os.makedirs(state, exist_ok=True)
    huge = tempfile.mkdtemp(prefix="ks-dump-targets-", dir="/dev/shm")
    subprocess.run(["mount", "-t", "tmpfs", "-o", workfs.options(4 << 30), "ks-dump-targets", huge], check=True)
    targets = {"/dev/shm": "/dev/shm", "tmpfs huge=within_size": huge, f"{state} (page cache)": state}
    try:
        print(f"# raw criu dump by place, medians of {a.runs} alternated rounds (after a warm-up round)\n")
        print("| workload | place | criu dump | vs /dev/shm | removing the dump | vs /dev/shm |")
        print("|---|---|---|---|---|---|")
        for kind in a.kinds.split(","):
            for mib in (int(s) for s in a.sizes.split(",")):
                got = measure(mib, kind, a.runs, targets)
                shm_dump, shm_rm = (statistics.median(v) for v in got["/dev/shm"])
                for name, (dumps, rms) in got.items():
                    dump, rm = statistics.median(dumps), statistics.median(rms)
                    print(f"| {kind} {mib} MiB | {name} | {dump:.0f} ms | {dump / shm_dump:.2f}x "
                          f"| {rm:.1f} ms | {rm / shm_rm:.2f}x |")  # fmt: skip
    finally:
        subprocess.run(["umount", huge], check=False)
        os.rmdir(huge)
    return 0


if __name__ == "__main__":
    sys.exit(main())
