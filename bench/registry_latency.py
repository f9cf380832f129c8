#!/usr/bin/env python3
"""What one blob costs the registry: the floor under content-addressed chunking.

    sudo .venv/bin/python bench/registry_latency.py [--blobs 64] [--kib 100] [--split-mib 7] [--rounds 3]

Pushes `--blobs` distinct blobs of `--kib` KiB (HEAD + POST + PUT each, through the project's
registry client) into the same Debian docker-registry the benchmark uses, with 1, 4, 8 and 16 threads,
and prints the effective time per blob next to a single upload of all the bytes as one blob. A
snapshot of N chunks pays about N x the per-blob figure on this registry, whatever their size.

A second table splits the same `--split-mib` MiB (about a 64 MiB object heap's compressed pages) into
1, 3, 6, 12 and 24 blobs pushed by 8 threads, as the agent pushes a snapshot's chunks, and gives the
CPU time each costs the client process and the registry process (medians of `--rounds`): what a
snapshot's blob count costs on two cores shared by both.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.reference import Reference
from tests.support.registry import RegistryServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blobs", type=int, default=64)
    ap.add_argument("--kib", type=int, default=100)
    ap.add_argument("--split-mib", type=float, default=7.0)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ksreglat-", dir="/var/tmp"))
    server = RegistryServer(work / "registry")
    server.start()
    try:
        client = RegistryClient()
        ref = Reference.parse(f"{server.host}/latency/x:v1")

        def push(blob: bytes) -> None:
            digest = "sha256:" + hashlib.sha256(blob).hexdigest()
            client.push_blob(ref, digest=digest, size=len(blob), data=blob)

        one = os.urandom(a.blobs * a.kib * 1024)
        t = time.monotonic()
        push(one)
        whole = time.monotonic() - t
        print(f"{a.blobs} blobs of {a.kib} KiB; the same {len(one) >> 10} KiB as one blob: {whole * 1000:.0f} ms\n")
        print("| threads | total | per blob | / one blob of all the bytes |\n|---|---|---|---|")
        for threads in (1, 4, 8, 16):
            blobs = [os.urandom(a.kib * 1024) for _ in range(a.blobs)]
            t = time.monotonic()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(push, blobs))
            total = time.monotonic() - t
            print(f"| {threads} | {total * 1000:.0f} ms | {total / a.blobs * 1000:.1f} ms | {total / whole:.1f}x |")
        split(client, server, a.split_mib, a.rounds)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split(client: RegistryClient, server: RegistryServer, mib: float, rounds: int) -> None:
    """The same bytes as 1..24 blobs: wall time and the CPU of this process and of the registry."""
    total = int(mib * (1 << 20))
    counts = (1, 3, 6, 12, 24)
    rows: dict[int, list[tuple[float, float, float]]] = {n: [] for n in counts}
    for rnd in range(rounds):
        for n in counts:  # alternated, round after round
            ref = Reference.parse(f"{server.host}/latency/split-{n}-{rnd}:v1")
            blobs = [os.urandom(total // n) for _ in range(n)]

            def push(blob: bytes, ref: Reference = ref) -> None:
                digest = "sha256:" + hashlib.sha256(blob).hexdigest()
                client.push_blob(ref, digest=digest, size=len(blob), data=blob)

            reg0, own0, t = cpu_s(server.pid), time.process_time(), time.monotonic()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(push, blobs))
            wall = time.monotonic() - t
            rows[n].append((wall, time.process_time() - own0, cpu_s(server.pid) - reg0))
    print(f"\nThe same {mib:g} MiB as N blobs, 8 threads (medians of {rounds}; CPU includes hashing the blobs)\n")
    print("| blobs | wall | client CPU | registry CPU | both CPU / one blob's |\n|---|---|---|---|---|")
    one = statistics.median(c + r for _, c, r in rows[1])
    for n in counts:
        wall, own, reg = (statistics.median(col) for col in zip(*rows[n], strict=True))
        both = statistics.median(c + r for _, c, r in rows[n])
        print(f"| {n} | {wall * 1000:.0f} ms | {own * 1000:.0f} ms | {reg * 1000:.0f} ms | {both / one:.2f}x |")


if __name__ == "__main__":
    main()
