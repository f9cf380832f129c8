"""Which pages really changed between two CRIU dumps, and what they weigh compressed (bench/run.py's
incremental rows, issue 16 item 2; bench/autosave_cost.py's changed bytes).

Pages are matched by (pagemap image, virtual address) and compared by content (a short hash); the
changed pages of the newer dump are compressed the way the agent compresses chunks (zstd at the
agent's level, one frame), which is the yardstick "uploaded vs compressed size of the pages that
really changed". Also times what hashing every page (page deltas, shim/engine/pageindex.py) costs
against compressing and hashing the same pages as chunks (what every save does anyway).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import zstandard

from kubectl_snapshot.core.pagedelta import PAGE_HASH_KEY_BYTES
from kubectl_snapshot.core.pagedelta import page_hashes as product_page_hashes
from shim.engine.chunks import read_pagemap
from shim.engine.stream import ZSTD_LEVEL

PAGE = 4096
READ_PAGES = 4096  # pages read at a time
PageKey = tuple[str, int]  # (pagemap image name, virtual address of the page)
FileOffset = tuple[str, int]  # (page file name, byte offset of the page in it)


def _runs(checkpoint_dir: Path) -> list[tuple[str, str, int, int, int]]:
    """(pagemap name, pages file, file offset, vaddr, pages) for every present run of every page file."""
    out = []
    for pm in sorted(checkpoint_dir.glob("pagemap-*.img")):
        pages_id, runs = read_pagemap(str(pm))
        offset = 0
        for run in runs:
            out.append((pm.name, f"pages-{pages_id}.img", offset, run.vaddr, run.nr_pages))
            offset += run.nr_pages * PAGE
    return out


def page_hashes(checkpoint_dir: Path) -> tuple[dict[PageKey, bytes], dict[PageKey, FileOffset]]:
    """A short digest of every dumped page, keyed by (pagemap image, virtual address), and where each
    page lies in its page file (to tell which chunks hold changed pages)."""
    digests: dict[PageKey, bytes] = {}
    where: dict[PageKey, FileOffset] = {}
    files: dict[str, Any] = {}
    try:
        for pm_name, pages_name, offset, vaddr, nr in _runs(checkpoint_dir):
            f = files.get(pages_name) or files.setdefault(pages_name, open(checkpoint_dir / pages_name, "rb"))  # noqa: SIM115
            f.seek(offset)
            done = 0
            while done < nr:
                n = min(READ_PAGES, nr - done)
                buf = memoryview(f.read(n * PAGE))
                if len(buf) != n * PAGE:
                    raise RuntimeError(f"{checkpoint_dir}: {pages_name} is shorter than {pm_name} says")
                base = vaddr + done * PAGE
                for j in range(n):
                    key = (pm_name, base + j * PAGE)
                    digests[key] = hashlib.blake2b(buf[j * PAGE : (j + 1) * PAGE], digest_size=8).digest()
                    where[key] = (pages_name, offset + (done + j) * PAGE)
                done += n
    finally:
        for f in files.values():
            f.close()
    return digests, where


def changed_pages(
    before: dict[PageKey, bytes] | None, checkpoint_dir: Path
) -> tuple[dict[PageKey, bytes], dict[str, Any]]:
    """The newer dump's page hashes and, against `before` (None: the first dump), how many bytes of
    pages changed (or appeared) and their size compressed like chunks."""
    after, where = page_hashes(checkpoint_dir)
    if before is None:
        return after, {}
    changed = sorted(where[k] for k, d in after.items() if before.get(k) != d)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    comp = cctx.compressobj()
    packed = 0
    files: dict[str, Any] = {}
    try:
        for name, offset in changed:
            f = files.get(name) or files.setdefault(name, open(checkpoint_dir / name, "rb"))  # noqa: SIM115
            f.seek(offset)
            packed += len(comp.compress(f.read(PAGE)))
        packed += len(comp.flush())
    finally:
        for f in files.values():
            f.close()
    return after, {"changed_bytes": len(changed) * PAGE, "changed_packed_bytes": packed, "pages": len(after)}


def hashing_cost(checkpoint_dir: Path, chunk: int = 8 << 20) -> dict[str, float]:
    """CPU seconds (one thread) to hash every page of the dump's page files as page deltas do (keyed,
    under a random key like a node's), and to compress + sha256 the same bytes as chunks (what a full
    save does with them anyway)."""
    key = os.urandom(PAGE_HASH_KEY_BYTES)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    t_hash = t_pack = 0.0
    for path in sorted(checkpoint_dir.glob("pages-*.img")):
        with open(path, "rb") as f:
            while raw := f.read(chunk):
                raw = raw[: len(raw) - len(raw) % PAGE]
                t = time.thread_time()
                product_page_hashes(raw, key)
                t_hash += time.thread_time() - t
                t = time.thread_time()
                hashlib.sha256(cctx.compress(raw)).digest()
                t_pack += time.thread_time() - t
    return {"page_hash_cpu_s": t_hash, "chunk_pack_cpu_s": t_pack}
