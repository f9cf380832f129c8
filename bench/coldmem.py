"""Dumps into memory the VM has taken back: what first touches cost, and whether writing ahead helps.

    sudo flock /run/ks-e2e.lock .venv/bin/python bench/coldmem.py [--sizes 64,512] [--kind objects]
                                                                  [--runs 3] [--hold-mib 4096]

These VMs back guest memory lazily and take back what stays free for a few seconds (virtio-balloon
free page reporting): the next first write to such a page traps to the host. The kernel hands out
recently freed pages first, so a dump is fast while such pages last and slow once something else
(the page cache growing, another dump kept) has used them up. This measures it on a host process of
the workload (bench/workload.py), dumped by raw ``criu dump --leave-running`` into a tmpfs mounted as
install-node mounts the memory work area (shim/host/workfs.py), three ways per round:

* warm: right after the previous dump was removed;
* cold: while this process holds --hold-mib of memory it has just written (they take the recently
  freed pages, so the dump gets memory that was given back);
* cold, written ahead: the same, after a file of the dump's size was written into the dump's
  directory and deleted (an attempt to fault the memory in before a freeze; its own time beside).

And once, how long writing fresh memory takes per 4 KiB page: the held memory's first write.
Prints medians of --runs rounds after a warm-up round.
"""

from __future__ import annotations

import argparse
import mmap
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
MADV_POPULATE_WRITE = 23
AHEAD_CHUNK = 4 << 20


def write_ahead(directory: str, nbytes: int) -> float:
    """ms to write `nbytes` of zeros to a file in `directory` and delete it."""
    t = time.monotonic()
    zeros = bytes(AHEAD_CHUNK)
    path = os.path.join(directory, ".ahead")
    with open(path, "wb") as f:
        for _ in range(0, nbytes, AHEAD_CHUNK):
            f.write(zeros)
    os.unlink(path)
    return (time.monotonic() - t) * 1000


def dump_ms(pid: int, base: str, ahead: int = 0) -> tuple[float, float]:
    """(the dump's ms, the write-ahead's ms) into a fresh directory under `base`, removed after."""
    d = tempfile.mkdtemp(dir=base)
    try:
        w = write_ahead(d, ahead) if ahead else 0.0
        t = time.monotonic()
        subprocess.run([CRIU, "dump", "-t", str(pid), "-D", d, "--leave-running", "--tcp-established",
                        "--file-locks", "-o", "dump.log"], check=True)  # fmt: skip
        return (time.monotonic() - t) * 1000, w
    finally:
        shutil.rmtree(d)


def hold(mib: int) -> tuple[mmap.mmap, float]:
    """`mib` of anonymous memory, written now, and µs per 4 KiB page that took."""
    t = time.monotonic()
    m = mmap.mmap(-1, mib << 20)
    try:
        m.madvise(MADV_POPULATE_WRITE)
    except OSError:  # before Linux 5.14: touch each page
        for off in range(0, mib << 20, mmap.PAGESIZE):
            m[off] = 1
    return m, (time.monotonic() - t) * 1e6 / ((mib << 20) // 4096)


def measure(mib: int, kind: str, runs: int, hold_mib: int, base: str) -> dict[str, list[float]]:
    keys = ("warm", "cold", "cold, written ahead", "write-ahead", "first write, us/page")
    out: dict[str, list[float]] = {k: [] for k in keys}
    with host_workload(Path(tempfile.gettempdir()), mib, kind) as pid:
        size = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * mmap.PAGESIZE
        for i in range(runs + 1):
            dump_ms(pid, base)  # the pages the warm dump reuses
            warm, _ = dump_ms(pid, base)
            m, per_page = hold(hold_mib)
            try:
                cold, _ = dump_ms(pid, base)
            finally:
                m.close()
            m, _ = hold(hold_mib)
            try:
                ahead, w = dump_ms(pid, base, ahead=size)
            finally:
                m.close()
            if i:
                for k, v in zip(keys, (warm, cold, ahead, w, per_page), strict=True):
                    out[k].append(v)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,512")
    ap.add_argument("--kind", default="objects", choices=("random", "objects"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--hold-mib",
        type=int,
        default=4096,
        help="memory taken and written before a cold dump (more than was freed recently, or it stays warm)",
    )
    a = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ks-coldmem-", dir="/dev/shm")
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", workfs.options(4 << 30), "ks-coldmem", base], check=True)
        print(f"# raw criu dump into install-node's kind of tmpfs, medians of {a.runs} rounds after a warm-up")
        print(f"# (cold: while {a.hold_mib} MiB just written are held)\n")
        print("| workload | warm | cold | cold / warm | cold, written ahead | that / warm | the write-ahead "
              "| first write of the held memory |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for mib in (int(s) for s in a.sizes.split(",")):
            got = {k: statistics.median(v) for k, v in measure(mib, a.kind, a.runs, a.hold_mib, base).items()}
            print(f"| {a.kind} {mib} MiB | {got['warm']:.0f} ms | {got['cold']:.0f} ms | "
                  f"{got['cold'] / got['warm']:.2f}x | {got['cold, written ahead']:.0f} ms | "
                  f"{got['cold, written ahead'] / got['warm']:.2f}x | {got['write-ahead']:.0f} ms | "
                  f"{got['first write, us/page']:.1f} us per 4 KiB page |", flush=True)  # fmt: skip
    finally:
        subprocess.run(["umount", base], check=False, stderr=subprocess.DEVNULL)
        os.rmdir(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
