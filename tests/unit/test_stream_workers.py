"""How many chunks the packaging pipeline handles at once: more for small (round-trip bound) chunks,
never more than the memory budget allows for large ones."""

from __future__ import annotations

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
