"""Where a dump goes (kubectl_snapshot/core/dumpspace.py): memory only where it clearly fits."""

from __future__ import annotations

import pytest

from kubectl_snapshot.core.dumpspace import DUMP_OVERHEAD, MIB, MemorySpace, dump_bytes, fits_in_memory

GIB = 1024 * MIB
ROOMY = MemorySpace(limit=GIB, reserved=0, fs_free=10 * GIB, mem_available=20 * GIB, headroom=2 * GIB)


def test_a_dump_reserves_its_pages_an_eighth_more_and_the_metadata() -> None:
    assert dump_bytes(64 * MIB) == 72 * MIB + DUMP_OVERHEAD
    assert dump_bytes(0) == DUMP_OVERHEAD


def test_a_small_dump_on_a_roomy_node_goes_to_memory() -> None:
    assert fits_in_memory(64 * MIB, ROOMY)
    assert fits_in_memory(0, ROOMY)


@pytest.mark.parametrize(
    ("expected", "space", "why"),
    [
        (None, ROOMY, "size unknown"),
        (-1, ROOMY, "nonsense size"),
        (64 * MIB, MemorySpace(0, 0, 10 * GIB, 20 * GIB, 2 * GIB), "the node turned it off"),
        (GIB, ROOMY, "over the limit with the slack"),
        (512 * MIB, MemorySpace(GIB, 600 * MIB, 10 * GIB, 20 * GIB, 2 * GIB), "beside the dumps in flight"),
        (64 * MIB, MemorySpace(GIB, 0, 64 * MIB, 20 * GIB, 2 * GIB), "the tmpfs is nearly full"),
        (512 * MIB, MemorySpace(GIB, 0, 10 * GIB, 2 * GIB + 512 * MIB, 2 * GIB), "the node's headroom"),
        (64 * MIB, MemorySpace(GIB, 900 * MIB, 10 * GIB, 2 * GIB + 950 * MIB, 2 * GIB), "headroom after the reserved"),
    ],
)
def test_anything_that_does_not_clearly_fit_goes_to_disk(expected: int | None, space: MemorySpace, why: str) -> None:
    assert not fits_in_memory(expected, space), why


def test_the_limit_is_inclusive() -> None:
    need = dump_bytes(100 * MIB)
    assert fits_in_memory(100 * MIB, MemorySpace(need, 0, need, need + GIB, GIB))
    assert not fits_in_memory(100 * MIB, MemorySpace(need - 1, 0, need, need + GIB, GIB))
    assert not fits_in_memory(100 * MIB, MemorySpace(need, 0, need - 1, need + GIB, GIB))
    assert not fits_in_memory(100 * MIB, MemorySpace(need, 0, need, need + GIB - 1, GIB))
