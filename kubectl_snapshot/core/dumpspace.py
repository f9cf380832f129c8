"""Whether a snapshot's dump goes to memory (a tmpfs) or to the node's disk: pure arithmetic.

CRIU writes a pod's memory pages while the pod is frozen, so where it writes is part of the freeze.
On disk the dump competes with everything else the node's disk does (and, on file systems mounted
with ``discard``, with the trims of the previous dump's deletion); a tmpfs takes it at memory speed.
But a dump in memory doubles the pod's footprint on the node until it is packaged and uploaded, so it
is used only where it clearly fits:

- the node allows it (``limit`` > 0: the most that dumps in memory may hold at once);
- the expected size is known (the containers' resident memory and their writable layers; CRIU's other
  images and the layer diff's tar headers are covered by DUMP_OVERHEAD and DUMP_SLACK);
- it fits beside the dumps already in memory within ``limit`` and within the tmpfs's free space;
- the node keeps ``headroom`` of available memory after it (the kubelet's evictions start near there).

Anything unknown means the disk, which is never wrong, only slower.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
DUMP_OVERHEAD = 16 * MIB  # CRIU's metadata images, the layer diff's headers, checkpointctl files
DUMP_SLACK = 8  # and 1/8 on top of the pages: resident memory moves between the check and the dump


@dataclass(frozen=True)
class MemorySpace:
    """What the node offers for dumps in memory, read just before the choice."""

    limit: int  # bytes all dumps in memory may take at once (0: never in memory)
    reserved: int  # bytes already promised to dumps in flight
    fs_free: int  # free bytes of the tmpfs
    mem_available: int  # the node's MemAvailable
    headroom: int  # available memory the node keeps after the dump


def dump_bytes(expected: int) -> int:
    """What to reserve for a dump of `expected` bytes of memory and writable layers."""
    return expected + expected // DUMP_SLACK + DUMP_OVERHEAD


def fits_in_memory(expected: int | None, space: MemorySpace) -> bool:
    """True when a dump of `expected` bytes (None: unknown) goes to memory."""
    if expected is None or expected < 0 or space.limit <= 0:
        return False
    need = dump_bytes(expected)
    return (
        space.reserved + need <= space.limit
        and need <= space.fs_free
        and space.reserved + need + space.headroom <= space.mem_available
    )
