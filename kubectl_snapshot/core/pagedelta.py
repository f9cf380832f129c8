"""Page deltas (format v4): a chunk stored as its base chunk plus the pages that changed since.

Why: a chunk is up to 16 MiB of one page file; a process that changes 5% of an object heap touches
pages all over it, so most chunks differ a little and a content-addressed chunk store re-uploads
each of them whole. A node that remembers, per chunk, a short hash of every page of the last chunk it
stored *whole* (its base) and which virtual addresses those pages had can tell which pages changed
and upload only those: a delta blob. Pages are matched by virtual address, so a chunk whose address
range gained or lost pages (a heap that grows) is still a delta of its base.

Why depth 1: a delta is always taken against the last *full* chunk of the same address range, never
against another delta, so a restore needs exactly two blobs per chunk (base, delta) and nothing of a
chain can go missing or grow without bound. The delta grows as more pages change, until too much of
the chunk differs (worth_a_delta); then the chunk is stored whole again and becomes the base.

Delta blob, before compression (then zstd and sealed exactly like a chunk); all integers u32 little
endian, all counts and indexes in pages::

    MAGIC (8) || out pages || C copies || L literals
    C x (out start, base start, count)      pages copied from the base chunk, in out order, disjoint
    L x out index                           strictly increasing
    L x PAGE_SIZE bytes                     the literal pages, in that order

The chunk is rebuilt as ``out pages`` pages; every one of them comes from exactly one copy or one
literal, every copy lies inside the base chunk. The config records C, L and the base's length, so a
reader knows the exact size of both blobs before it decompresses anything (hostile input is bounded).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3

from kubectl_snapshot.core.chunks import PAGE_SIZE, delta_raw_length
from kubectl_snapshot.core.errors import DigestMismatch

MAGIC = b"KSPDELT1"
_HEADER = struct.Struct("<8sIII")
_COPY = struct.Struct("<III")
# at most this share of a chunk's pages in a delta; beyond it the chunk is stored whole (a new base)
MAX_DELTA_FRACTION = 0.5
# ... or up to this share while at least 3/4 of the delta changed since the previous snapshot
MAX_LARGE_DELTA_FRACTION = 0.875
PAGE_HASH_BYTES = 16  # keyed BLAKE3, 128 bits: no accidents, and no collision anyone can aim for
PAGE_HASH_KEY_BYTES = 32  # BLAKE3's key
_HINT = "the snapshot is corrupted or was crafted; do not restore it"


@dataclass(frozen=True)
class DeltaPlan:
    """How to build a chunk from its base: runs of base pages to copy and the pages to send."""

    pages: int  # pages of the new chunk
    copies: tuple[tuple[int, int, int], ...]  # (out start, base start, count)
    literals: tuple[int, ...]  # out indexes, sorted

    @property
    def identical(self) -> bool:
        """The chunk is its base, page for page (nothing to send, not even a delta)."""
        return not self.literals and self.copies == ((0, 0, self.pages),)


def page_hashes(raw: bytes | bytearray | memoryview, key: bytes) -> bytes:
    """The concatenated PAGE_HASH_BYTES-byte hashes of every page of `raw` (a multiple of PAGE_SIZE):
    BLAKE3 in keyed mode under the node's page hash key, what a page index compares to tell changed
    pages from unchanged ones.

    Why keyed: a page whose hash equals its base page's is not sent, and the restore puts the base's
    page there. With an unkeyed hash (XXH3-128, say: second preimages are cheap) whoever knows
    what a page of a save will hold (a zero page, a library's data) can write a different page with the
    same hash at that address of a process that shares the base, and the next save keeps the crafted
    page as "unchanged": its restore writes those bytes into the victim. Keyed by a secret no workload
    knows (shim/engine/pageindex.py: random per node, kept in the agent's root-only state, never in a
    snapshot), a collision cannot be aimed at; by accident it is 2^-128 per page pair. These hashes
    name no blob and no key (every stored byte is named by its blob's sha256 in the signed config).

    Why BLAKE3 and not keyed BLAKE2b (hashlib): one C call per page either way, and BLAKE3's SIMD makes
    it about 3x cheaper per page here (docs/performance.md, "Keyed page hashes")."""
    if len(raw) % PAGE_SIZE:
        raise ValueError("page hashes need whole pages")
    if len(key) != PAGE_HASH_KEY_BYTES:
        raise ValueError(f"the page hash key must be {PAGE_HASH_KEY_BYTES} bytes")
    h = blake3.blake3
    n = PAGE_HASH_BYTES
    with memoryview(raw) as view:
        return b"".join([h(view[i : i + PAGE_SIZE], key=key).digest(n) for i in range(0, len(view), PAGE_SIZE)])


def page_addresses(layout: bytes) -> list[int]:
    """The virtual address of every page of a chunk from its layout ((vaddr, bytes) u64 pairs)."""
    out: list[int] = []
    for k in range(0, len(layout) - 15, 16):
        vaddr, n = struct.unpack_from("<QQ", layout, k)
        out.extend(range(vaddr, vaddr + n, PAGE_SIZE))
    return out


def plan_delta(base_layout: bytes, base_hashes: bytes, layout: bytes, hashes: bytes) -> DeltaPlan | None:
    """Match the pages of a chunk (`layout`, `hashes`) to those of its base by virtual address and
    content. None when the layouts or hashes are inconsistent (then: no delta)."""
    base_addrs, addrs = page_addresses(base_layout), page_addresses(layout)
    h = PAGE_HASH_BYTES
    if len(base_addrs) * h != len(base_hashes) or len(addrs) * h != len(hashes) or not addrs:
        return None
    if base_addrs == addrs and base_hashes == hashes:
        return DeltaPlan(len(addrs), ((0, 0, len(addrs)),), ())
    where = {a: i for i, a in enumerate(base_addrs)}
    copies: list[tuple[int, int, int]] = []
    literals: list[int] = []
    for i, a in enumerate(addrs):
        j = where.get(a)
        if j is None or base_hashes[j * h : (j + 1) * h] != hashes[i * h : (i + 1) * h]:
            literals.append(i)
        elif copies and copies[-1][0] + copies[-1][2] == i and copies[-1][1] + copies[-1][2] == j:
            copies[-1] = (copies[-1][0], copies[-1][1], copies[-1][2] + 1)
        else:
            copies.append((i, j, 1))
    return DeltaPlan(len(addrs), tuple(copies), tuple(literals))


def worth_a_delta(changed: int, pages: int, fresh: int | None = None) -> bool:
    """Whether a chunk of `pages` pages of which `changed` must be sent (differ from or are missing in
    its base) is stored as a delta (else whole, as the new base). `fresh`: how many of them differ from
    the chunk's previous version (the last snapshot's; None when that was the base itself).

    Up to MAX_DELTA_FRACTION of the chunk: a delta. Beyond that, still a delta while most of it is new
    since the last snapshot (sending it costs about what really changed, where the whole chunk would
    cost up to twice that) and it is not nearly the whole chunk; a delta made mostly of pages that
    earlier snapshots sent already is not sent again and again: the chunk becomes a new base (unless
    nothing changed since: then it is the last snapshot's delta, which costs nothing to name again).
    """
    if changed <= pages * MAX_DELTA_FRACTION or fresh == 0:
        return True  # fresh == 0: the very delta the last snapshot stored (the registry has it: free)
    new = changed if fresh is None else fresh
    return changed <= pages * MAX_LARGE_DELTA_FRACTION and new * 4 >= changed * 3


def encode_delta(raw: bytes | bytearray | memoryview, plan: DeltaPlan) -> bytes:
    """The delta blob (uncompressed) that rebuilds chunk `raw` from its base following `plan`."""
    if len(raw) != plan.pages * PAGE_SIZE:
        raise ValueError("the delta plan is for another chunk")
    parts = [_HEADER.pack(MAGIC, plan.pages, len(plan.copies), len(plan.literals))]
    parts.extend(_COPY.pack(*c) for c in plan.copies)
    parts.append(struct.pack(f"<{len(plan.literals)}I", *plan.literals))
    with memoryview(raw) as view:
        parts.extend(bytes(view[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]) for i in plan.literals)
    return b"".join(parts)


def apply_delta(
    base: bytes | bytearray | memoryview,
    delta: bytes | bytearray | memoryview,
    *,
    length: int,
    literals: int,
    copies: int,
    where: str,
) -> bytearray:
    """The chunk of `length` bytes rebuilt from `base` (the verified, decompressed base chunk) and
    `delta` (the verified, decompressed delta blob, which the config says holds `literals` pages and
    `copies` copy runs). Refuses anything malformed before writing a byte: wrong length, magic or
    counts, a copy outside the base or the chunk, an index out of the chunk, unsorted or repeated,
    a page of the chunk covered twice or not at all."""
    if len(base) % PAGE_SIZE or not base or length % PAGE_SIZE or not length:
        raise DigestMismatch(f"{where}: the chunk or its base is not whole pages", hint=_HINT)
    if len(delta) != delta_raw_length(literals, copies):
        raise DigestMismatch(
            f"{where}: the page delta holds {len(delta)} bytes, {literals} pages and {copies} copies make "
            f"{delta_raw_length(literals, copies)}",
            hint=_HINT,
        )
    magic, out_pages, n_copies, n_literals = _HEADER.unpack_from(delta, 0)
    if magic != MAGIC:
        raise DigestMismatch(f"{where}: the page delta has no delta header", hint=_HINT)
    if (out_pages, n_copies, n_literals) != (length // PAGE_SIZE, copies, literals):
        raise DigestMismatch(
            f"{where}: the page delta says {out_pages} pages, {n_copies} copies, {n_literals} literal pages; "
            f"the snapshot says {length // PAGE_SIZE}, {copies}, {literals}",
            hint=_HINT,
        )
    base_pages = len(base) // PAGE_SIZE
    covered = bytearray(out_pages)
    runs = [_COPY.unpack_from(delta, _HEADER.size + k * _COPY.size) for k in range(n_copies)]
    end = 0
    for out_start, base_start, count in runs:
        if count < 1 or out_start < end or out_start + count > out_pages or base_start + count > base_pages:
            raise DigestMismatch(
                f"{where}: a page delta copies {count} pages from base page {base_start} to page {out_start}: "
                f"out of order, overlapping, or outside the base ({base_pages} pages) or the chunk ({out_pages})",
                hint=_HINT,
            )
        covered[out_start : out_start + count] = b"\1" * count
        end = out_start + count
    pos = _HEADER.size + n_copies * _COPY.size
    indexes = struct.unpack_from(f"<{n_literals}I", delta, pos)
    prev = -1
    for i in indexes:
        if i <= prev or i >= out_pages or covered[i]:
            raise DigestMismatch(
                f"{where}: page delta index {i} is out of order, repeated, copied too or outside the chunk's "
                f"{out_pages} pages",
                hint=_HINT,
            )
        covered[i] = 1
        prev = i
    if covered.count(0):
        raise DigestMismatch(
            f"{where}: the page delta leaves {covered.count(0)} of the chunk's {out_pages} pages unset", hint=_HINT
        )
    out = bytearray(length)
    with memoryview(base) as src, memoryview(delta) as d:
        for out_start, base_start, count in runs:
            out[out_start * PAGE_SIZE : (out_start + count) * PAGE_SIZE] = src[
                base_start * PAGE_SIZE : (base_start + count) * PAGE_SIZE
            ]
        data = pos + 4 * n_literals
        for k, i in enumerate(indexes):
            out[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] = d[data + k * PAGE_SIZE : data + (k + 1) * PAGE_SIZE]
    return out
