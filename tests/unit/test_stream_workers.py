"""How many chunks the packaging pipeline handles at once: more for small (round-trip bound) chunks,
never more than the memory budget allows for large ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shim.engine import stream


def test_small_chunks_get_more_workers_within_the_cap() -> None:
    assert stream.workers_for(1 << 20) == stream.MAX_IO_WORKERS
    assert stream.workers_for(0) == stream.MAX_IO_WORKERS


def test_large_chunks_stay_within_the_memory_budget() -> None:
    for mib in (4, 8, 16):
        n = stream.workers_for(mib << 20)
        assert n >= stream.WORKERS
        assert n * 2 * (mib << 20) <= max(stream.CHUNK_MEMORY_BUDGET, stream.WORKERS * 2 * (mib << 20))
    assert stream.workers_for(16 << 20) == stream.WORKERS


class _Blobs:
    """A registry's blob reads (a dict of digest -> bytes), counted; fetch_chunks needs nothing else."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs
        self.fetched: list[str] = []

    def fetch_blob(self, ref: object, digest: str, out: Any, **_: Any) -> int:
        self.fetched.append(digest)
        out.write(self.blobs[digest])
        return len(self.blobs[digest])


def test_a_chunk_used_in_several_places_is_downloaded_once_and_written_to_each(tmp_path: Path) -> None:
    """A forked worker's copy of its parent's memory (or a repeat within one process) is one blob."""
    import hashlib

    import zstandard

    from kubectl_snapshot.core.chunks import Chunk, PagesFile
    from kubectl_snapshot.core.reference import Reference

    page_a, page_b = b"a" * 4096 * 2, b"b" * 4096 * 2
    blobs: dict[str, bytes] = {}
    for raw in (page_a, page_b):
        z = zstandard.ZstdCompressor().compress(raw)
        blobs["sha256:" + hashlib.sha256(z).hexdigest()] = z
    (da, za), (db, zb) = blobs.items()
    parent = PagesFile("pages-1.img", 4 * 4096, (Chunk(0, 8192, da, len(za)), Chunk(8192, 8192, db, len(zb))))
    worker = PagesFile("pages-2.img", 4 * 4096, (Chunk(0, 8192, da, len(za)), Chunk(8192, 8192, da, len(za))))
    reg = _Blobs(blobs)
    counted: list[int] = []
    got = stream.fetch_chunks(
        reg,  # type: ignore[arg-type]
        Reference.parse("reg.example/ns/app@sha256:" + "0" * 64),
        [parent, worker],
        str(tmp_path),
        on_bytes=counted.append,
    )
    assert sorted(reg.fetched) == sorted([da, db])  # three uses of `a`, one download
    assert got == len(za) + len(zb)  # what was downloaded
    assert sum(counted) == 3 * len(za) + len(zb)  # progress counts every use, as the restore's plan does
    assert (tmp_path / "pages-1.img").read_bytes() == page_a + page_b
    assert (tmp_path / "pages-2.img").read_bytes() == page_a + page_a
