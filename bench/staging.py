#!/usr/bin/env python3
"""The agent's staging of a snapshot against the raw parallel download of the same blobs (issue 44, item 1).

    .venv/bin/python -m bench.staging [--sizes 2048,8192] [--runs 3] [--modes clear,sealed,lazy,write] [--out FILE]

For each size S MiB: a container dump of S MiB of pages is written under --workdir (default /var/tmp),
streamed, not held in memory: one ``pages-1.img`` with its ``pagemap-1.img`` (a heap cut at the chunk span
plus small mappings), mostly incompressible (AES-CTR keystream), ~10% zero pages in runs, ~2% of the heap's
chunks all zero and ~5% repeating an earlier chunk, beside a few small CRIU-like images. It is packaged by
the agent's own code (shim/engine/package.py, shim/engine/publish.py) into a real loopback registry (Debian's
``docker-registry``, tests/support/registry.py), once in clear and once sealed, and the dump is deleted.

Then, alternating the order round by round (R rounds), in the same run:
* raw: every blob a staging downloads (the layer and each distinct chunk), fetched by the registry client
  to a sink (digest checked as it streams, as bench/recovery.py's bound), as many at once as the staging
  fetches chunks (shim/engine/stream.fetch_workers) plus the layer;
* clear / sealed: ``stage_artifact`` (shim/engine/restore.py) into a fresh state dir on the same
  filesystem, the staged dir removed and the page cache written back (``sync``) outside the timing;
* lazy / lazy-sealed (issue 44, item 2's ">= 0.8x of the download bandwidth"): a lazy restore's page source
  (shim/engine/lazysource.py, the agent's cache and read-ahead) serving every page as CRIU's lazy-pages
  daemon fills them, in address order, one request at a time (the daemon's socket and its copies into
  the process are not in it: bench/lazy_restore.py times those);
* write: the page files' bytes alone written into fresh files on the same filesystem, as staging writes
  them: the share of a staging that is the page cache's (on a VM whose host takes free memory back, each
  new page's first write traps: docs/performance.md, "Memory the VM took back").
Printed: staging/raw per round (median and range) per mode, and the staging's own split (timings_ms);
no absolute time is a claim, only the ratio to the raw download of the same round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.artifact import Artifact, load_artifact
from kubectl_snapshot.core.chunks import PAGE_SIZE, choose_span
from kubectl_snapshot.core.model import ContainerRecord, DumpStats, HostFacts, SnapshotConfig
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import LocalNamespaceKey, Opener, Sealer, new_key
from shim.criu.lazyimages import TaskLayout
from shim.criu.pageproto import LazyLayout, PageRange
from shim.engine.chunks import IMG_COMMON_MAGIC, PAGEMAP_MAGIC
from shim.engine.lazyrestore import READAHEAD_CHUNKS, SESSION_CACHE_BYTES
from shim.engine.lazysource import ChunkPageSource, from_registry
from shim.engine.package import package_container
from shim.engine.publish import push_snapshot
from shim.engine.restore import stage_artifact
from shim.engine.staging import StatePaths
from shim.engine.stream import fetch_workers
from shim.host import malloc
from tests.support.registry import RegistryServer

NAMESPACE = "bench"
ZERO_PAGES = 0.10  # share of the heap's pages that are zero, in runs
ZERO_CHUNKS = 0.02  # share of the heap's chunks all zero
REPEATED_CHUNKS = 0.05  # share of the heap's chunks that repeat an earlier one
SMALL_MAPPINGS = 24  # libraries, stacks: a few pages each, below the heap


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb(fields: dict[int, int]) -> bytes:
    return b"".join(_varint(k << 3) + _varint(v) for k, v in fields.items())


def pagemap(pages_id: int, runs: list[tuple[int, int]]) -> bytes:
    """A CRIU pagemap image: its head, then (vaddr, nr_pages) runs, all present."""
    msgs = [_pb({1: pages_id}), *(_pb({1: vaddr, 4: 4, 5: n}) for vaddr, n in runs)]
    return struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + b"".join(struct.pack("<I", len(m)) + m for m in msgs)


class _Pages:
    """Deterministic page content: an AES-CTR keystream per piece (fast, incompressible)."""

    def __init__(self, seed: int) -> None:
        self.key = seed.to_bytes(4, "little") * 8

    def random(self, n: int, index: int) -> bytearray:
        enc = Cipher(algorithms.AES(self.key), modes.CTR(index.to_bytes(16, "little"))).encryptor()
        return bytearray(enc.update(bytes(n)))


HEAP_BASE = 0x10000000  # span-aligned: the heap's chunks are whole spans


def dump_runs(mib: int) -> list[tuple[int, int]]:
    """The (vaddr, nr_pages) runs of the dump's pagemap, in the pages file's order: the heap, then the
    small mappings."""
    small = [(0x7F0000000000 + i * (1 << 24), 1 + (i * 7) % 16) for i in range(SMALL_MAPPINGS)]
    small_bytes = sum(n for _, n in small) * PAGE_SIZE
    return [(HEAP_BASE, ((mib << 20) - small_bytes) // PAGE_SIZE), *small]


def write_dump(cdir: Path, mib: int, seed: int = 1) -> dict[str, int]:
    """The dump of one container holding `mib` MiB of pages (checkpointctl layout); returns its make-up."""
    cp = cdir / C.CHECKPOINT_DIRECTORY
    cp.mkdir(parents=True)
    span = choose_span(mib << 20)
    gen = _Pages(seed)
    runs = dump_runs(mib)
    heap_pages, small = runs[0][1], runs[1:]
    made = {"bytes": 0, "zero_pages": 0, "zero_chunks": 0, "repeated_chunks": 0, "chunks": 0}
    pieces = span // PAGE_SIZE
    chunk_count = -(-heap_pages // pieces)
    with open(cp / "pages-1.img", "wb") as f:
        kept: list[bytes] = []  # a few earlier chunks, to repeat (at most 8 held)
        for i in range(chunk_count):
            n = min(pieces, heap_pages - i * pieces) * PAGE_SIZE
            roll = (i * 2654435761 + seed) % 1000 / 1000
            if i and roll < ZERO_CHUNKS:
                data = bytearray(n)
                made["zero_chunks"] += 1
                made["zero_pages"] += n // PAGE_SIZE
            elif i and roll < ZERO_CHUNKS + REPEATED_CHUNKS and kept and len(kept[-1]) == n:
                data = bytearray(kept[(i * 31) % len(kept)])
                made["repeated_chunks"] += 1
            else:
                data = gen.random(n, i)
                # zero runs of 1..64 pages, about ZERO_PAGES of the chunk's pages
                page = (i * 13) % 64
                while page < n // PAGE_SIZE:
                    run = min(1 + (page * 7 + i) % 64, n // PAGE_SIZE - page)
                    data[page * PAGE_SIZE : (page + run) * PAGE_SIZE] = bytes(run * PAGE_SIZE)
                    made["zero_pages"] += run
                    page += int(run / ZERO_PAGES)
                if len(kept) < 8 and n == span:
                    kept.append(bytes(data))
            f.write(data)
            made["chunks"] += 1
        for i, (_vaddr, n) in enumerate(small):
            f.write(gen.random(n * PAGE_SIZE, (1 << 40) + i))
    made["bytes"] = (cp / "pages-1.img").stat().st_size
    (cp / "pagemap-1.img").write_bytes(pagemap(1, runs))
    for k, name in enumerate(("core-1.img", "mm-1.img", "pstree.img", "files.img", "fdinfo-2.img", "inventory.img")):
        (cp / name).write_bytes(gen.random(4096 + k * 512, (1 << 50) + k))
    (cdir / C.STATS_DUMP_FILE).write_bytes(b"")
    (cdir / "config.dump").write_text("{}")
    (cdir / "spec.dump").write_text("{}")
    return made


def package(registry: RegistryServer, cdir: Path, mib: int, sealer: Sealer | None) -> Artifact:
    """The dump packaged and published as the agent does (chunks, layer, config, manifest)."""
    client = RegistryClient()
    target = Reference.parse(f"{registry.host}/staging-bench/s{mib}-{uuid.uuid4().hex[:8]}:v1")
    pc = package_container(client, target, str(cdir), sealer=sealer)
    pages = sum(p.size for p in pc.pages)
    rec = ContainerRecord(
        name="app", id="app", image="bench", image_digest="", layer_digest=pc.layer.digest, spec={},
        stats=DumpStats(process_count=1, memory_bytes=pages, pages_written=pages // PAGE_SIZE), pages=pc.pages,
    )  # fmt: skip
    config = SnapshotConfig(
        group="bench", namespace=NAMESPACE, created="2026-01-01T00:00:00Z", containers=(rec,), host=HostFacts()
    )
    if sealer is not None:
        config = replace(config, encryption=sealer.info(config.blob_digests()))
    result, _ = push_snapshot(target, config, [rec], [pc], None, client)
    return load_artifact(client, result.reference)


def blobs_of(artifact: Artifact) -> dict[str, int]:
    """What a staging downloads: each container's layer and each distinct chunk (with its delta)."""
    sizes = {d.digest: d.size for d in artifact.manifest.layers}
    out = {rec.layer_digest: sizes[rec.layer_digest] for rec in artifact.config.containers}
    for rec in artifact.config.containers:
        for p in rec.pages:
            for c in p.chunks:
                out[c.digest] = c.size
                if c.delta is not None:
                    out[c.delta.digest] = c.delta.size
    return out


class _Sink:
    def write(self, b: bytes) -> int:
        return len(b)

    def seekable(self) -> bool:
        return False


def raw_download(artifact: Artifact, streams: int) -> float:
    """Seconds to download every blob of `blobs_of(artifact)`, `streams` at a time, digests checked."""
    client = RegistryClient()
    blobs = sorted(blobs_of(artifact).items(), key=lambda kv: -kv[1])
    t = time.monotonic()

    def fetch(item: tuple[str, int]) -> int:
        return client.fetch_blob(artifact.reference, item[0], _Sink(), expected_size=item[1])  # type: ignore[arg-type]

    with ThreadPoolExecutor(streams) as pool:
        got = sum(pool.map(fetch, blobs))
    assert got == sum(s for _, s in blobs)
    return time.monotonic() - t


def stage(artifact: Artifact, opener: Opener | None, workdir: Path) -> tuple[float, dict[str, float], int]:
    """Seconds of one stage_artifact, its timings, and the blocks its page files take on disk."""
    paths = StatePaths(tempfile.mkdtemp(prefix="state-", dir=workdir))
    target = paths.staged_by_id("bench")
    timings: dict[str, float] = {}
    try:
        t = time.monotonic()
        stage_artifact(artifact, [target], registry=RegistryClient(), paths=paths, opener=opener, timings=timings)
        took = time.monotonic() - t
        cp = os.path.join(target, C.CHECKPOINT_DIRECTORY)
        blocks = sum(os.stat(os.path.join(cp, p.name)).st_blocks * 512 for p in artifact.config.containers[0].pages)
    finally:
        shutil.rmtree(paths.root, ignore_errors=True)
        os.sync()  # the next measurement does not write this one's pages back
    return took, timings, blocks


# CRIU's lazy-pages daemon (criu/uffd.c, update_xfer_len): 64 KiB, then 64 KiB more per request, up to 4 MiB
FILL_STEP_PAGES, FILL_MAX_PAGES = 16, 1024


def lazy_tasks(mib: int) -> dict[int, TaskLayout]:
    """The dump's one task with every page lazy (what a lazy restore of it serves), ranges by address."""
    lazy, offset = [], 0
    for vaddr, n in dump_runs(mib):  # the pages file's order
        lazy.append(PageRange(vaddr, n, offset))
        offset += n * PAGE_SIZE
    return {1: TaskLayout(1, 1, LazyLayout((), (), tuple(sorted(lazy, key=lambda r: r.vaddr))))}


def lazy_fill(
    artifact: Artifact, opener: Opener | None, mib: int, readahead: int = READAHEAD_CHUNKS
) -> tuple[float, int]:
    """Seconds for the agent's lazy page source (shim/engine/lazysource.py, with the agent's cache and
    read-ahead) to serve every page the way CRIU's daemon fills what no fault asked for: in address order,
    one request at a time, 64 KiB growing by 64 KiB per request to 4 MiB; and the chunks it downloaded.
    `readahead`: chunks read ahead (the cache grows to hold them beside the one served)."""
    tasks = lazy_tasks(mib)
    files = {p.name: p for p in artifact.config.containers[0].pages}
    span = max((c.length for p in files.values() for c in p.chunks), default=0)
    source = ChunkPageSource(
        tasks, files, from_registry(RegistryClient(), artifact.reference, opener),
        cache_bytes=max(SESSION_CACHE_BYTES, (readahead + 1) * span), readahead=readahead,
    )  # fmt: skip
    served = 0
    t = time.monotonic()
    try:
        ask = FILL_STEP_PAGES  # per task, across its ranges
        for r in tasks[1].layout.lazy:
            vaddr, left = r.vaddr, r.nr_pages
            while left:
                with memoryview(source.pages(1, vaddr, min(ask, left))) as data:
                    got = len(data) // PAGE_SIZE
                vaddr, left, served = vaddr + got * PAGE_SIZE, left - got, served + got
                ask = min(ask + FILL_STEP_PAGES, FILL_MAX_PAGES)
        took = time.monotonic() - t
    finally:
        source.close()
    assert served == source.total_pages()
    return took, source.fetched


def write_only(artifact: Artifact, workdir: Path) -> float:
    """Seconds to write the page files' bytes alone into fresh files on the same filesystem, as staging
    writes them (blocks allocated first, a chunk at a time from one buffer kept from chunk to chunk): the
    part of a staging that puts the pod's memory into the page cache, which the raw download does not do."""
    pages = artifact.config.containers[0].pages
    buf = memoryview(os.urandom(max((c.length for p in pages for c in p.chunks), default=0)))
    d = tempfile.mkdtemp(prefix="write-", dir=workdir)
    try:
        t = time.monotonic()
        for p in pages:
            fd = os.open(os.path.join(d, p.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, p.size)
                for c in p.chunks:
                    os.posix_fallocate(fd, c.offset, c.length)
                    os.pwrite(fd, buf[: c.length], c.offset)
            finally:
                os.close(fd)
        return time.monotonic() - t
    finally:
        shutil.rmtree(d, ignore_errors=True)
        os.sync()


@dataclass
class Case:
    mode: str  # clear, sealed: stage_artifact; lazy, lazy-sealed: lazy_fill; write: write_only
    artifact: Artifact
    opener: Opener | None
    readahead: int = READAHEAD_CHUNKS  # lazy modes: chunks read ahead


MODES = ("clear", "sealed", "lazy", "lazy-sealed", "write")


def measure(
    registry: RegistryServer, workdir: Path, mib: int, runs: int, wanted: list[str], readaheads: list[int] | None = None
) -> dict[str, Any]:
    key = LocalNamespaceKey(new_key())
    cdir = workdir / f"dump-{mib}"
    made = write_dump(cdir, mib)
    cases: list[Case] = []
    packaged_s: dict[str, float] = {}
    packaged: dict[str, tuple[Artifact, Opener | None]] = {}
    try:
        for mode in wanted:
            how = "sealed" if mode.endswith("sealed") else "clear"
            if how not in packaged:
                t = time.monotonic()
                artifact = package(registry, cdir, mib, Sealer(key, NAMESPACE) if how == "sealed" else None)
                packaged_s[how] = time.monotonic() - t
                enc = artifact.config.encryption
                packaged[how] = (artifact, Opener(enc, key) if enc is not None else None)
            if mode.startswith("lazy") and readaheads:
                cases += [Case(f"{mode} r{n}", *packaged[how], readahead=n) for n in readaheads]
            else:
                cases.append(Case(mode, *packaged[how]))
    finally:
        shutil.rmtree(cdir, ignore_errors=True)
    os.sync()
    pages = cases[0].artifact.config.containers[0].pages
    streams = fetch_workers(pages) + 1  # the chunks' workers and the layer's download beside them
    raw: list[float] = []
    staged: dict[str, list[float]] = {c.mode: [] for c in cases}
    split: dict[str, list[dict[str, float]]] = {c.mode: [] for c in cases}
    blocks = 0
    fetched: dict[str, int] = {}
    for i in range(runs + 1):  # round 0 warms the registry's files into the page cache; not counted
        order: list[Case | None] = [None, *cases]
        if i % 2:
            order.reverse()
        for case in order:
            if case is None:
                took = raw_download(cases[0].artifact, streams)
                if i:
                    raw.append(took)
            elif case.mode == "write":
                took = write_only(case.artifact, workdir)
                if i:
                    staged[case.mode].append(took)
            elif case.mode.startswith("lazy"):
                took, fetched[case.mode] = lazy_fill(case.artifact, case.opener, mib, case.readahead)
                if i:
                    staged[case.mode].append(took)
            else:
                took, timings, blocks = stage(case.artifact, case.opener, workdir)
                if i:
                    staged[case.mode].append(took)
                    split[case.mode].append(timings)
            print(f"  {mib} MiB round {i} {'raw' if case is None else case.mode}: {took:.2f} s", file=sys.stderr)
    ratios = {m: [s / r for s, r in zip(v, raw, strict=True)] for m, v in staged.items()}
    return {
        "mib": mib,
        "dump": made,
        "streams": streams,
        "chunks": sum(len(p.chunks) for p in pages),
        "distinct_blobs": len(blobs_of(cases[0].artifact)),
        "download_bytes": sum(blobs_of(cases[0].artifact).values()),
        "page_file_bytes": sum(p.size for p in pages),
        "page_file_blocks": blocks,
        "raw_s": raw,
        "staged_s": staged,
        "ratios": ratios,
        "timings_ms": split,
        "packaged_s": packaged_s,
        "lazy_chunks_fetched": fetched,
    }


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| pod memory | mode | time / raw download (median) | range | rounds "
        "| split of the staging (median ms / staging) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        for mode, rs in row["ratios"].items():
            med = statistics.median(rs)
            parts = {
                "write": "the page files' bytes written alone (the page-cache part of a staging)",
            }.get(mode, "every page served in CRIU's fill order (goal <= 1.25x: >= 0.8x the download's bandwidth)")
            if row["timings_ms"][mode]:
                st = statistics.median(row["staged_s"][mode]) * 1000
                keys = ("layers_ms", "extract_ms", "pages_ms", "pages_wait_ms")
                parts = ", ".join(
                    f"{k[:-3]} {statistics.median(t.get(k, 0.0) for t in row['timings_ms'][mode]) / st:.2f}"
                    for k in keys
                )
            lines.append(
                f"| {row['mib']} MiB | {mode} | **{med:.2f}x** | {min(rs):.2f}x-{max(rs):.2f}x | {len(rs)} | {parts} |"
            )
    for row in rows:
        lazy = "".join(f"; {m} downloaded {n} chunks" for m, n in row.get("lazy_chunks_fetched", {}).items())
        lines.append(
            f"\n{row['mib']} MiB: {row['chunks']} chunks, {row['distinct_blobs']} distinct blobs downloaded, "
            f"{row['download_bytes'] / row['page_file_bytes']:.2f}x the page files' bytes; raw download "
            f"{row['streams']} streams; page files take {row['page_file_blocks'] / row['page_file_bytes']:.2f}x "
            f"their length on disk (holes for zero pages){lazy}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def registry_in(workdir: Path) -> Iterator[RegistryServer]:
    workdir.mkdir()
    reg = RegistryServer(workdir)
    reg.start()
    try:
        yield reg
    finally:
        reg.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048,8192", help="MiB of pod memory, comma-separated")
    ap.add_argument("--runs", type=int, default=3, help="rounds per size (after one warm-up round)")
    ap.add_argument("--modes", default="clear,sealed", help=f"any of {', '.join(MODES)}")
    ap.add_argument("--workdir", default="/var/tmp", help="where the dump, the registry and the staging go")
    ap.add_argument("--out", help="write the measurements as JSON here")
    ap.add_argument("--readahead", help="lazy modes: chunks read ahead, comma-separated (one case each; "
                    f"default the agent's {READAHEAD_CHUNKS})")  # fmt: skip
    args = ap.parse_args()
    readaheads = [int(n) for n in args.readahead.split(",")] if args.readahead else None
    wanted = [m for m in args.modes.split(",") if m]
    if not wanted or set(wanted) - set(MODES):
        ap.error(f"--modes: any of {', '.join(MODES)}")
    malloc.tune()  # as the agent does (shim/agent_cli.py): chunk buffers from the heap
    rows = []
    with tempfile.TemporaryDirectory(prefix="ks-bench-staging-", dir=args.workdir) as tmp:
        work = Path(tmp)
        for mib in (int(s) for s in args.sizes.split(",")):
            with registry_in(work / f"registry-{mib}") as reg:  # each size its own, removed after it
                rows.append(measure(reg, work, mib, args.runs, wanted, readaheads))
            shutil.rmtree(work / f"registry-{mib}", ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    print(report(rows))


if __name__ == "__main__":
    main()
