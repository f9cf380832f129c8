"""Memory pages as content-addressed chunks (format v2): the records, the boundaries, the checks.

Why chunks: a second snapshot of a process whose memory changed a little should upload only what
changed. The kernel here has no soft-dirty tracking (no ``criu pre-dump``), so change is found by
content: each ``pages-N.img`` of a CRIU dump is cut into chunks, each chunk is compressed on its own
and stored as a blob named by its digest; a registry that already has a blob is not sent it again.

Why boundaries follow virtual addresses, not file offsets: a page file lists the present pages in
address order, so one page more or less anywhere shifts every later file offset and would change
every later fixed-offset chunk. Cutting where the *virtual address* crosses a multiple of the span
keeps chunk contents stable when other mappings grow or shrink. Tiny neighbours are merged so that a
process with many small mappings does not turn into thousands of blobs.

Why restores can trust the result: a chunk is a byte range ``[offset, offset+length)`` of one page
file plus the digest of its compressed blob; the chunks of a file must tile it exactly (sorted, no
gap, no overlap), so a restore writes every byte once, and every blob is verified by digest before
its bytes are written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.oci import is_digest

PAGE_SIZE = 4096
# 4 MiB: the span of the smallest dumps (under ~22 MiB of pages); a page file smaller than this stays
# in the container's layer
MIN_SPAN = 4 << 20
# 16 MiB: the most a restore accepts (MAX_CHUNK_BYTES). With page deltas a save sends what changed
# whatever the span: a chunk changed in part goes up as a delta of its pages, one changed through and
# through is as large as its changed pages (bench/autosave_cost.py: 2 GiB, 1% changed per save, chunks sent
# 1.00x the changed pages with 16 MiB spans). Before page deltas 8 MiB kept that under 2x.
MAX_SPAN = 16 << 20
# per snapshot: each blob costs registry requests (HEAD, POST, PUT) and file operations whatever its
# size, CPU of the registry's and the client's on the cores that also compress (bench/registry_latency.py:
# a 64 MiB object heap's 7 MiB as 12 blobs cost both processes 3.8x the CPU of one blob, as 6 2.5x),
# while two cores need only a few chunks to compress in parallel: so a small pod's snapshot is a few
# blobs (a 64 MiB one about 6 of 16 MiB), a large one many of MAX_SPAN
TARGET_CHUNKS = 4
MAX_CHUNK_BYTES = 16 << 20  # a restore holds a few chunks in memory: refuse bigger ones
MAX_PAGES_FILE_BYTES = 1 << 40
PAGES_FILE_RE = re.compile(r"^pages-[1-9][0-9]{0,9}\.img$")
_HINT = "the artifact is damaged or was not made by kubectl-snapshot"


@dataclass(frozen=True)
class PagemapRun:
    """Present pages of one pagemap entry: `nr_pages` pages from `vaddr`, stored consecutively."""

    vaddr: int
    nr_pages: int


@dataclass(frozen=True)
class Span:
    """A byte range of a page file, before compression."""

    offset: int
    length: int


@dataclass(frozen=True)
class Delta:
    """Format v4: the blob that rebuilds a chunk from its base: `copies` runs of base pages and `pages`
    literal pages (core/pagedelta.py); the base chunk is `base_length` bytes before compression."""

    digest: str
    size: int
    pages: int
    copies: int
    base_length: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "size": self.size,
            "pages": self.pages,
            "copies": self.copies,
            "baseLength": self.base_length,
        }


@dataclass(frozen=True)
class Chunk:
    """One stored chunk: raw range of the page file + the digest and size of its compressed blob.

    With `delta` (format v4) the blob named by `digest` is the chunk's *base* (an earlier full version
    of the same range, same length) and the chunk's content is the base with the delta's pages put in
    (core/pagedelta.py)."""

    offset: int
    length: int
    digest: str
    size: int
    delta: Delta | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"offset": self.offset, "length": self.length, "digest": self.digest, "size": self.size}
        if self.delta is not None:
            d["delta"] = self.delta.to_dict()
        return d


@dataclass(frozen=True)
class PagesFile:
    """A CRIU ``pages-N.img`` stored as chunks instead of inside the container's tar layer."""

    name: str  # file name inside checkpoint/ (pages-N.img)
    size: int
    chunks: tuple[Chunk, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "chunks": [c.to_dict() for c in self.chunks]}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> PagesFile:
        if not isinstance(d, dict):
            raise _bad(f"{where} is not an object")
        name, size, raw_chunks = d.get("name"), d.get("size"), d.get("chunks")
        if not isinstance(name, str) or not PAGES_FILE_RE.match(name):
            raise _bad(f"{where} has an invalid page file name {name!r}")
        if not _is_int(size) or not 0 <= size <= MAX_PAGES_FILE_BYTES:
            raise _bad(f"{where} has an invalid size {size!r}")
        if not isinstance(raw_chunks, list):
            raise _bad(f"{where} has no chunk list")
        chunks = tuple(_chunk(c, f"{where} chunk {i}") for i, c in enumerate(raw_chunks))
        pf = cls(name, size, chunks)
        check_tiling(pf, where)
        return pf


def _chunk(d: Any, where: str) -> Chunk:
    if not isinstance(d, dict):
        raise _bad(f"{where} is not an object")
    offset, length, digest, size = d.get("offset"), d.get("length"), d.get("digest"), d.get("size")
    if not _is_int(offset) or offset < 0:
        raise _bad(f"{where} has an invalid offset {offset!r}")
    if not _is_int(length) or not 0 < length <= MAX_CHUNK_BYTES:
        raise _bad(f"{where} has an invalid length {length!r} (1..{MAX_CHUNK_BYTES})")
    if not isinstance(digest, str) or not is_digest(digest):
        raise _bad(f"{where} has an invalid digest {digest!r}")
    # a zstd frame of `length` bytes is never much larger than length; bound what a restore downloads
    raw_delta = d.get("delta")
    delta = None if raw_delta is None else _delta(raw_delta, length, f"{where} delta")
    base_length = length if delta is None else delta.base_length  # what the blob named by digest holds
    if not _is_int(size) or not 0 < size <= blob_size_limit(base_length):
        raise _bad(f"{where} has an invalid blob size {size!r}")
    return Chunk(offset, length, digest, size, delta)


def blob_size_limit(raw_length: int) -> int:
    """The largest stored (compressed, maybe sealed) blob of `raw_length` bytes a reader accepts: a zstd
    frame is never much larger than its input; bounds what a restore downloads."""
    return raw_length + (raw_length >> 7) + 4096


DELTA_HEADER_BYTES = 20  # core/pagedelta.py: magic (8), chunk pages, copies, literal pages (u32 each)


def delta_raw_length(pages: int, copies: int) -> int:
    """Bytes of a page delta of `pages` literal pages and `copies` copy runs before compression."""
    return DELTA_HEADER_BYTES + copies * 12 + pages * (4 + PAGE_SIZE)


def _delta(d: Any, length: int, where: str) -> Delta:
    if not isinstance(d, dict):
        raise _bad(f"{where} is not an object")
    digest, size, pages = d.get("digest"), d.get("size"), d.get("pages")
    copies, base_length = d.get("copies"), d.get("baseLength")
    if length % PAGE_SIZE:
        raise _bad(f"{where}: a chunk of {length} bytes (not whole pages) cannot have a page delta")
    out_pages = length // PAGE_SIZE
    if not _is_int(pages) or not 0 <= pages <= out_pages:
        raise _bad(f"{where} has an invalid page count {pages!r} (0..{out_pages})")
    if not _is_int(copies) or not 0 <= copies <= out_pages - pages or copies + pages == 0:
        raise _bad(f"{where} has an invalid copy count {copies!r} (0..{out_pages - pages}, with the pages at least 1)")
    if not _is_int(base_length) or not 0 < base_length <= MAX_CHUNK_BYTES or base_length % PAGE_SIZE:
        raise _bad(f"{where} has an invalid base length {base_length!r} (whole pages, at most {MAX_CHUNK_BYTES})")
    if not isinstance(digest, str) or not is_digest(digest):
        raise _bad(f"{where} has an invalid digest {digest!r}")
    if not _is_int(size) or not 0 < size <= blob_size_limit(delta_raw_length(pages, copies)):
        raise _bad(f"{where} has an invalid blob size {size!r}")
    return Delta(digest, size, pages, copies, base_length)


def check_tiling(pf: PagesFile, where: str = "page file") -> None:
    """The chunks must cover [0, size) exactly, in order: every byte written once by a restore."""
    pos = 0
    for i, c in enumerate(pf.chunks):
        if c.offset != pos:
            raise _bad(f"{where} ({pf.name}): chunk {i} starts at {c.offset}, expected {pos} (gap or overlap)")
        pos += c.length
    if pos != pf.size:
        raise _bad(f"{where} ({pf.name}): chunks cover {pos} bytes of {pf.size}")


def choose_span(total_bytes: int) -> int:
    """The chunk span for a dump of `total_bytes` of pages: a power of two near total/TARGET_CHUNKS.

    Rounded in log space (not up), so a process hovering around a size keeps its span, and with it
    its chunk boundaries, from one snapshot to the next.
    """
    if total_bytes <= 0:
        return MIN_SPAN
    exp = round(math.log2(max(total_bytes / TARGET_CHUNKS, 1)))
    return int(min(MAX_SPAN, max(MIN_SPAN, 1 << exp)))


def plan_chunks(runs: Iterable[PagemapRun], file_size: int, span: int) -> list[Span]:
    """Cut a page file whose present pages are `runs` (in file order) at span-aligned addresses.

    A new chunk starts where the address window (vaddr // span) changes; chunks smaller than a
    quarter span are merged into the next when the sum stays within a span. Returns ranges tiling
    [0, file_size); if the runs do not account for the file exactly, falls back to fixed offsets
    (still correct, only less stable).
    """
    if span <= 0 or span % PAGE_SIZE:
        raise ValueError("span must be a positive multiple of the page size")
    cuts: list[int] = []
    pos = 0
    window: int | None = None
    for run in runs:
        if run.nr_pages <= 0:
            continue
        length = run.nr_pages * PAGE_SIZE
        first = run.vaddr // span
        if first != window:
            cuts.append(pos)
        # every span-aligned address strictly inside this run starts a chunk
        aligned = (first + 1) * span
        while aligned < run.vaddr + length:
            cuts.append(pos + aligned - run.vaddr)
            aligned += span
        window = (run.vaddr + length - 1) // span
        pos += length
    if pos != file_size:
        return fixed_chunks(file_size, span)
    return _merge_small(_ranges(cuts, file_size), span)


def span_layouts(runs: Iterable[PagemapRun], file_size: int, spans: Sequence[Span]) -> list[bytes] | None:
    """Per span, which virtual addresses its pages hold: (vaddr, bytes) pieces packed as u64 pairs.

    Two chunks with equal layouts hold the same pages of the address space, page for page, so the
    later one can be stored as a page delta of the earlier (core/pagedelta.py). Adjacent pieces are
    joined, so that how CRIU splits an address range into pagemap entries does not matter. None when the runs do
    not account for the file exactly (then no chunk of it gets a delta)."""
    pieces: list[tuple[int, int, int]] = []  # (file offset, vaddr, bytes)
    pos = 0
    for run in runs:
        if run.nr_pages > 0:
            pieces.append((pos, run.vaddr, run.nr_pages * PAGE_SIZE))
            pos += run.nr_pages * PAGE_SIZE
    if pos != file_size:
        return None
    out: list[bytes] = []
    k = 0
    for s in spans:
        end = s.offset + s.length
        layout = bytearray()
        while k < len(pieces) and pieces[k][0] + pieces[k][2] <= s.offset:
            k += 1
        j = k
        merged: list[list[int]] = []  # CRIU may split one address range into several entries: join them
        while j < len(pieces) and pieces[j][0] < end:
            off, vaddr, n = pieces[j]
            a, b = max(off, s.offset), min(off + n, end)
            if merged and merged[-1][0] + merged[-1][1] == vaddr + a - off:
                merged[-1][1] += b - a
            else:
                merged.append([vaddr + a - off, b - a])
            j += 1
        for vaddr, n in merged:
            layout += vaddr.to_bytes(8, "little") + n.to_bytes(8, "little")
        out.append(bytes(layout))
    return out


def fixed_chunks(file_size: int, span: int) -> list[Span]:
    return [Span(o, min(span, file_size - o)) for o in range(0, file_size, span)]


def _ranges(cuts: Sequence[int], end: int) -> list[Span]:
    if end <= 0:
        return []
    points = sorted({0, *(c for c in cuts if 0 <= c < end)})
    return [Span(a, b - a) for a, b in zip(points, [*points[1:], end], strict=True) if b > a]


def _merge_small(spans: list[Span], span: int) -> list[Span]:
    out: list[Span] = []
    for s in spans:
        if out and out[-1].length < span // 4 and out[-1].length + s.length <= span:
            prev = out.pop()
            s = Span(prev.offset, prev.length + s.length)
        out.append(s)
    return out


def parse_pages_files(raw: Any, where: str) -> tuple[PagesFile, ...]:
    """The ``pages`` list of a container record (format v2); absent in v1."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _bad(f"{where} pages is not a list")
    files = tuple(PagesFile.from_dict(p, f"{where} pages[{i}]") for i, p in enumerate(raw))
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise _bad(f"{where} lists a page file twice")
    return files


def chunk_digests(files: Iterable[PagesFile]) -> list[str]:
    """Every distinct chunk digest (bases and deltas), in first-use order (one manifest layer each)."""
    seen: dict[str, None] = {}
    for f in files:
        for c in f.chunks:
            seen.setdefault(c.digest, None)
            if c.delta is not None:
                seen.setdefault(c.delta.digest, None)
    return list(seen)


def delta_digests(files: Iterable[PagesFile]) -> set[str]:
    """The digests that are page deltas (listed with the delta media type)."""
    return {c.delta.digest for f in files for c in f.chunks if c.delta is not None}


def has_deltas(files: Iterable[PagesFile]) -> bool:
    return any(c.delta is not None for f in files for c in f.chunks)


def chunk_sizes(files: Iterable[PagesFile]) -> Mapping[str, int]:
    sizes = {c.digest: c.size for f in files for c in f.chunks}
    sizes.update({c.delta.digest: c.delta.size for f in files for c in f.chunks if c.delta is not None})
    return sizes


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(message: str) -> FailedPrecondition:
    return FailedPrecondition(message, hint=_HINT)
