"""Page deltas (format v4): a chunk stored as its base chunk plus the pages that changed since.

Why: a chunk is up to 8 MiB of one page file; a process that changes 5% of an object heap touches
pages all over it, so most chunks differ a little and a content-addressed chunk store re-uploads
each of them whole. A node that remembers, per chunk, a short hash of every page of the last chunk it
stored *whole* (its base) can tell which pages changed and upload only those: a delta blob.

Why depth 1: a delta is always taken against the last *full* chunk of the same address range, never
against another delta, so a restore needs exactly two blobs per chunk (base, delta) and nothing of a
chain can go missing or grow without bound. The delta grows as more pages change, until too much of
the chunk differs (worth_a_delta); then the chunk is stored whole again and becomes the base.

Delta blob, before compression (then zstd and sealed exactly like a chunk)::

    MAGIC (8 bytes) || u32 count N (little endian) || N x u32 page index || N x PAGE_SIZE page bytes

Indexes are page numbers within the chunk, strictly increasing (sorted, unique), each below the
chunk's page count; the blob is exactly ``delta_raw_length(N)`` bytes. The config records N, so a
reader knows the exact decompressed size before it decompresses anything (hostile input is bounded).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from kubectl_snapshot.core.chunks import PAGE_SIZE, delta_raw_length
from kubectl_snapshot.core.errors import DigestMismatch

MAGIC = b"KSPDELT1"
_HEADER = struct.Struct("<8sI")
# at most this share of a chunk's pages in a delta; beyond it the chunk is stored whole (a new base)
MAX_DELTA_FRACTION = 0.5
# ... or up to this share while at least 3/4 of the delta changed since the previous snapshot
MAX_LARGE_DELTA_FRACTION = 0.875
PAGE_HASH_BYTES = 16  # truncated sha256 (SHA-NI makes it the fastest hash here; 128 bits: no accidents)
_HINT = "the snapshot is corrupted or was crafted; do not restore it"


def page_hashes(raw: bytes | bytearray | memoryview) -> bytes:
    """The concatenated PAGE_HASH_BYTES-byte hashes of every page of `raw` (a multiple of PAGE_SIZE)."""
    if len(raw) % PAGE_SIZE:
        raise ValueError("page hashes need whole pages")
    out = bytearray()
    sha = hashlib.sha256
    with memoryview(raw) as view:
        for i in range(0, len(view), PAGE_SIZE):
            out += sha(view[i : i + PAGE_SIZE]).digest()[:PAGE_HASH_BYTES]
    return bytes(out)


def changed_pages(base: bytes, new: bytes) -> list[int] | None:
    """Indexes of the pages whose hash differs between two page-hash strings; None when the chunks do
    not have the same number of pages (no delta possible)."""
    if len(base) != len(new) or len(base) % PAGE_HASH_BYTES:
        return None
    n = PAGE_HASH_BYTES
    if base == new:
        return []
    return [i // n for i in range(0, len(new), n) if base[i : i + n] != new[i : i + n]]


def worth_a_delta(changed: int, pages: int, fresh: int | None = None) -> bool:
    """Whether a chunk of `pages` pages of which `changed` differ from its base is stored as a delta
    (else whole, as the new base). `fresh`: how many of them differ from the chunk's previous version
    (the last snapshot's; None when unknown, i.e. the previous version was the base).

    Up to MAX_DELTA_FRACTION of the chunk: a delta. Beyond that, still a delta while most of it is new
    since the last snapshot (sending it costs about what really changed, where the whole chunk would
    cost up to twice that) and it is not nearly the whole chunk; a delta made mostly of pages that
    earlier snapshots sent already is not sent again and again: the chunk becomes a new base.
    """
    if changed <= 0:
        return False
    if changed <= pages * MAX_DELTA_FRACTION:
        return True
    new = changed if fresh is None else fresh
    return changed <= pages * MAX_LARGE_DELTA_FRACTION and new * 4 >= changed * 3


def encode_delta(raw: bytes | bytearray | memoryview, indexes: Sequence[int]) -> bytes:
    """The delta blob (uncompressed) holding pages `indexes` (sorted, unique) of chunk `raw`."""
    pages = len(raw) // PAGE_SIZE
    _check_indexes(indexes, pages, "delta")
    parts = [_HEADER.pack(MAGIC, len(indexes)), struct.pack(f"<{len(indexes)}I", *indexes)]
    with memoryview(raw) as view:
        parts.extend(bytes(view[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]) for i in indexes)
    return b"".join(parts)


def apply_delta(base: bytearray, delta: bytes | bytearray | memoryview, *, pages: int, where: str) -> None:
    """Replace pages of `base` (the verified, decompressed base chunk) by those of `delta` (the verified,
    decompressed delta blob, which the config says holds `pages` pages). Refuses anything malformed:
    wrong length, magic or count, an index out of the chunk, unsorted or repeated."""
    if len(base) % PAGE_SIZE or not base:
        raise DigestMismatch(f"{where}: the base chunk is not whole pages ({len(base)} bytes)", hint=_HINT)
    if len(delta) != delta_raw_length(pages):
        raise DigestMismatch(
            f"{where}: the page delta holds {len(delta)} bytes, {pages} pages make {delta_raw_length(pages)}",
            hint=_HINT,
        )
    magic, count = _HEADER.unpack_from(delta, 0)
    if magic != MAGIC:
        raise DigestMismatch(f"{where}: the page delta has no delta header", hint=_HINT)
    if count != pages:
        raise DigestMismatch(f"{where}: the page delta says {count} pages, the snapshot says {pages}", hint=_HINT)
    indexes = struct.unpack_from(f"<{count}I", delta, _HEADER.size)
    _check_indexes(indexes, len(base) // PAGE_SIZE, where)
    data = _HEADER.size + 4 * count
    with memoryview(delta) as view:
        for k, i in enumerate(indexes):
            src = data + k * PAGE_SIZE
            base[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] = view[src : src + PAGE_SIZE]


def _check_indexes(indexes: Sequence[int], pages: int, where: str) -> None:
    if not indexes:
        raise DigestMismatch(f"{where}: a page delta holds no pages", hint=_HINT)
    prev = -1
    for i in indexes:
        if i <= prev:
            raise DigestMismatch(
                f"{where}: page delta indexes are not sorted and unique ({prev}, then {i})", hint=_HINT
            )
        if i >= pages:
            raise DigestMismatch(f"{where}: page delta index {i} is outside the chunk's {pages} pages", hint=_HINT)
        prev = i
