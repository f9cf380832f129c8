#!/usr/bin/env python3
"""What one blob costs the registry: the floor under content-addressed chunking.

    sudo .venv/bin/python bench/registry_latency.py [--blobs 64] [--kib 100]

Pushes `--blobs` distinct blobs of `--kib` KiB (HEAD + POST + PUT each, through the project's
registry client) into the same Debian docker-registry the benchmark uses, with 1, 4, 8 and 16 threads,
and prints the effective time per blob next to a single upload of all the bytes as one blob. A
snapshot of N chunks pays about N x the per-blob figure on this registry, whatever their size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
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
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
