"""CRIU's page-server protocol and the lazy layout of a dump, pure (no I/O): lazy restore, issue 44.

A lazy restore (post-copy) brings a process back before its memory: ``criu restore --lazy-pages``
(``runc restore --lazy-pages``) leaves the pagemap entries marked ``PE_LAZY`` unfilled and hands each
restored task's userfaultfd to ``criu lazy-pages``; with ``--page-server --address A --port P`` that
daemon asks a page server on A:P for each range a fault (or its background transfer) needs. The agent
is that page server (shim/criu/pageserver.py). From CRIU's source (criu/page-xfer.c, criu/uffd.c):

- Every message is a ``struct page_server_iov`` in the host's byte order and alignment. Its layout
  changed in CRIU 4.2 (7e0da4d97 "pagemap: use unsigned long for page counts"): up to 4.1
  ``{u32 cmd; u32 nr_pages; u64 vaddr; u64 dst_id}`` (24 bytes), from 4.2
  ``{u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id}`` (32 bytes: 4 bytes of padding after ``cmd``).
  The two do not understand each other: the layout is chosen by the CRIU version (`iov_layout`).
- ``cmd``'s low 16 bits are the command, its high 16 bits flags (``PS_IOV_ADD_F`` carries the pagemap
  flags there).
- The lazy-pages daemon connects once its restore has handed it the userfaultfds and sends no open:
  only ``PS_IOV_GET`` (nr_pages, vaddr, dst_id = the task's pid in the images, plain, not
  ``encode_dst_id``'s form), pipelined. Each is answered in order by ``PS_IOV_ADD_F|PE_PRESENT`` with
  the same vaddr and dst_id and 1 <= nr_pages <= what was asked, followed by the raw pages. CRIU's own
  server closes the connection where it has no page (it never answers nr_pages 0).
- When every page is in, the daemon sends ``PS_IOV_CLOSE`` and waits for a 4-byte status (0).
- The dump side's messages (``PS_IOV_OPEN2`` answered by a has-parent byte, ``PS_IOV_ADD_F`` followed
  by pages, ``PS_IOV_CLOSE`` answered by the status) are decoded here too, for completeness; dst_id
  is then ``encode_dst_id``'s.

Which pages may be lazy is CRIU's rule (criu/include/vma.h ``vma_entry_can_be_lazy``, criu/mem.c): a
private anonymous VMA that is not locked, vDSO, vvar, vsyscall or hugetlb; and never the page of a
thread's stack pointer (``is_stack``). `lazy_layout` applies it to a dump taken eagerly: the lazy
ranges are served by the page server, the others stay in the pages image the restore reads.
"""

from __future__ import annotations

import bisect
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

PAGE_SIZE = 4096

PS_IOV_ADD = 1
PS_IOV_HOLE = 2
PS_IOV_OPEN = 3
PS_IOV_OPEN2 = 4
PS_IOV_PARENT = 5
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
COMMANDS = frozenset(
    {PS_IOV_ADD, PS_IOV_HOLE, PS_IOV_OPEN, PS_IOV_OPEN2, PS_IOV_PARENT, PS_IOV_ADD_F, PS_IOV_GET}
    | {PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE}
)

PS_CMD_BITS = 16
PS_CMD_MASK = (1 << PS_CMD_BITS) - 1
PS_TYPE_BITS = 8
PS_TYPE_MASK = (1 << PS_TYPE_BITS) - 1
PS_TYPE_PID = 1
PS_TYPE_SHMEM = 2
# dst_id types written by older CRIUs (decode_pm in criu/page-xfer.c)
_LEGACY_PID_TYPES = frozenset({10, 11, 16, 17})
_LEGACY_SHMEM_TYPES = frozenset({27, 28, 29, 32, 33, 34})

# pagemap entry flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2

# mmap flags and CRIU's VMA status bits (criu/include/image.h)
MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
MAP_LOCKED = 0x2000
MAP_HUGETLB = 0x40000
VMA_AREA_VSYSCALL = 1 << 2
VMA_AREA_VDSO = 1 << 3
VMA_AREA_VVAR = 1 << 12

LAYOUT_24 = struct.Struct("=IIQQ")  # CRIU <= 4.1
LAYOUT_32 = struct.Struct("=I4xQQQ")  # CRIU >= 4.2
CLOSE_STATUS = struct.Struct("=i")
_VERSION = re.compile(r"(\d+)\.(\d+)")


class ProtocolError(ValueError):
    """A message that is not CRIU's page-server protocol (or not the layout agreed)."""


def iov_layout(criu_version: str) -> struct.Struct:
    """The ``page_server_iov`` layout the CRIU of that version (e.g. "4.2.1") sends and expects."""
    m = _VERSION.match(criu_version.strip())
    if not m:
        raise ProtocolError(f"not a CRIU version: {criu_version!r}")
    major, minor = int(m.group(1)), int(m.group(2))
    return LAYOUT_32 if (major, minor) >= (4, 2) else LAYOUT_24


def encode_cmd(cmd: int, flags: int = 0) -> int:
    return (flags << PS_CMD_BITS) | cmd


@dataclass(frozen=True)
class Iov:
    """One ``page_server_iov``: `cmd` without its flags, which are in `flags`."""

    cmd: int
    nr_pages: int = 0
    vaddr: int = 0
    dst_id: int = 0
    flags: int = 0

    def encode(self, layout: struct.Struct) -> bytes:
        try:
            return layout.pack(encode_cmd(self.cmd, self.flags), self.nr_pages, self.vaddr, self.dst_id)
        except struct.error as e:
            raise ProtocolError(f"cannot encode {self}: {e}") from e

    @property
    def length(self) -> int:
        """Bytes of page data that follow this message on the wire."""
        return self.nr_pages * PAGE_SIZE


def decode_iov(data: bytes | bytearray | memoryview, layout: struct.Struct) -> Iov:
    if len(data) != layout.size:
        raise ProtocolError(f"a page_server_iov is {layout.size} bytes here, got {len(data)}")
    raw, nr_pages, vaddr, dst_id = layout.unpack(data)
    cmd, flags = raw & PS_CMD_MASK, raw >> PS_CMD_BITS
    if cmd not in COMMANDS or (flags and cmd != PS_IOV_ADD_F):
        raise ProtocolError(
            f"unknown page-server command {raw:#x} (a CRIU of another protocol layout, "
            f"{'4.2+' if layout is LAYOUT_24 else '4.1 or older'}?)"
        )
    return Iov(cmd=cmd, nr_pages=nr_pages, vaddr=vaddr, dst_id=dst_id, flags=flags)


def get_request(dst_id: int, vaddr: int, nr_pages: int) -> Iov:
    """What the lazy-pages daemon sends for `nr_pages` pages at `vaddr` of task `dst_id`."""
    return Iov(cmd=PS_IOV_GET, nr_pages=nr_pages, vaddr=vaddr, dst_id=dst_id)


def pages_reply(request: Iov, nr_pages: int) -> Iov:
    """The answer to a GET (followed by `nr_pages` pages): at most what it asked, at least one page."""
    if request.cmd != PS_IOV_GET:
        raise ProtocolError(f"only a GET is answered with pages, not command {request.cmd}")
    if not 1 <= nr_pages <= request.nr_pages:
        raise ProtocolError(f"a GET of {request.nr_pages} pages cannot be answered with {nr_pages}")
    return Iov(cmd=PS_IOV_ADD_F, nr_pages=nr_pages, vaddr=request.vaddr, dst_id=request.dst_id, flags=PE_PRESENT)


def close_reply(status: int = 0) -> bytes:
    """The answer to PS_IOV_CLOSE / PS_IOV_FORCE_CLOSE."""
    return CLOSE_STATUS.pack(status)


def encode_dst_id(pid: int, *, shmem: bool = False) -> int:
    """dst_id as the dump side sends it in OPEN/ADD (encode_pm): the id shifted over a type byte."""
    return (pid << PS_TYPE_BITS) | (PS_TYPE_SHMEM if shmem else PS_TYPE_PID)


def decode_dst_id(dst_id: int) -> tuple[str, int]:
    """("pid" | "shmem", id) of an encoded dst_id, with the numbers older CRIUs used."""
    kind = dst_id & PS_TYPE_MASK
    if kind == PS_TYPE_PID or kind in _LEGACY_PID_TYPES:
        return "pid", dst_id >> PS_TYPE_BITS
    if kind == PS_TYPE_SHMEM or kind in _LEGACY_SHMEM_TYPES:
        return "shmem", dst_id >> PS_TYPE_BITS
    raise ProtocolError(f"unknown pagemap type {kind} in dst_id {dst_id:#x}")


class PageSource(Protocol):
    """Where a page server's pages come from: a dump's pages image, or the registry's chunks."""

    def pages(self, dst_id: int, vaddr: int, nr_pages: int) -> bytes | bytearray | memoryview:
        """Up to `nr_pages` pages of task `dst_id` from `vaddr` (at least one, whole pages; fewer where
        the range the source holds ends sooner). Raises KeyError where it holds no page at `vaddr`, and
        OSError (or an error of its own) where it cannot read them now."""
        ...


# --- the lazy layout of an eager dump ---------------------------------------------------------


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    flags: int  # mmap flags
    status: int  # CRIU's VMA_AREA_* bits


@dataclass(frozen=True)
class PagemapEntry:
    vaddr: int
    nr_pages: int
    flags: int

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE


@dataclass(frozen=True)
class PageRange:
    """`nr_pages` pages at `vaddr` that are at `offset` in the dump's pages image."""

    vaddr: int
    nr_pages: int
    offset: int

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE


@dataclass(frozen=True)
class LazyLayout:
    """One task's pagemap for a lazy restore: `entries` (lazy ones flagged PE_LAZY and not present),
    `kept` (what the restore's pages image holds, in that order: ranges of the original one) and `lazy`
    (what the page server serves)."""

    entries: tuple[PagemapEntry, ...]
    kept: tuple[PageRange, ...]
    lazy: tuple[PageRange, ...]

    @property
    def lazy_pages(self) -> int:
        return sum(r.nr_pages for r in self.lazy)

    @property
    def kept_pages(self) -> int:
        return sum(r.nr_pages for r in self.kept)


def can_be_lazy(vma: Vma) -> bool:
    """CRIU's vma_entry_can_be_lazy: what its restorer registers with the task's userfaultfd."""
    if not (vma.flags & MAP_ANONYMOUS and vma.flags & MAP_PRIVATE):
        return False
    if vma.flags & (MAP_LOCKED | MAP_HUGETLB):
        return False
    return not any(vma.status & bit == bit for bit in (VMA_AREA_VDSO, VMA_AREA_VVAR, VMA_AREA_VSYSCALL))


# CRIU's lazy-pages daemon (4.2, and its master at the time of writing: criu/uffd.c, collect_iovs) keeps the
# longest lazy range of a task in an int and allocates a buffer that long: a lazy pagemap entry of 2 GiB or
# more makes it exit, silently, before the first page (the restore then fails with "Failed sending restore
# finished indication"). Lazy entries are cut at this length; the daemon moves at most 4 MiB at a time.
MAX_LAZY_ENTRY_PAGES = (64 << 20) // PAGE_SIZE


def _split(r: PageRange) -> tuple[PageRange, ...]:
    """`r` in pieces of at most MAX_LAZY_ENTRY_PAGES pages, in order (offsets stay contiguous)."""
    step = MAX_LAZY_ENTRY_PAGES
    return tuple(
        PageRange(r.vaddr + i * PAGE_SIZE, min(step, r.nr_pages - i), r.offset + i * PAGE_SIZE)
        for i in range(0, r.nr_pages, step)
    )


def lazy_layout(vmas: Sequence[Vma], entries: Sequence[PagemapEntry], stack_pointers: Iterable[int]) -> LazyLayout:
    """The lazy layout of one task's eager pagemap (entries in image order, each PE_PRESENT; the pages
    image holds them in that order). Entries are split at VMA bounds and around stack pages; adjacent
    pieces of one kind are joined again, lazy ones up to MAX_LAZY_ENTRY_PAGES."""
    vmas = sorted(vmas, key=lambda v: v.start)
    starts = [v.start for v in vmas]
    stack_pages = {sp & ~(PAGE_SIZE - 1) for sp in stack_pointers}

    def lazy_at(addr: int) -> tuple[bool, int]:
        """(may the page at addr be lazy, the end of the run of pages of that kind from addr)."""
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= vmas[i].end:
            nxt = starts[i + 1] if i + 1 < len(starts) else 1 << 64
            return False, nxt
        vma = vmas[i]
        if not can_be_lazy(vma):
            return False, vma.end
        if addr in stack_pages:
            return False, addr + PAGE_SIZE
        following = [p for p in stack_pages if addr < p < vma.end]
        return True, min([vma.end, *following])

    pieces: list[tuple[bool, PageRange]] = []
    offset = 0
    for e in entries:
        if e.flags & PE_PARENT or not e.flags & PE_PRESENT:
            raise ProtocolError(
                f"pagemap entry at {e.vaddr:#x} is not a present page range (flags {e.flags:#x}): "
                "only a full dump can be restored lazily"
            )
        addr = e.vaddr
        while addr < e.end:
            lazy, run_end = lazy_at(addr)
            end = min(e.end, run_end)
            n = (end - addr) // PAGE_SIZE
            prev = pieces[-1] if pieces else None
            if (
                prev
                and prev[0] == lazy
                and prev[1].end == addr
                and prev[1].offset + prev[1].nr_pages * PAGE_SIZE == offset
            ):
                pieces[-1] = (lazy, PageRange(prev[1].vaddr, prev[1].nr_pages + n, prev[1].offset))
            else:
                pieces.append((lazy, PageRange(addr, n, offset)))
            offset += n * PAGE_SIZE
            addr = end
    pieces = [(lazy, part) for lazy, r in pieces for part in (_split(r) if lazy else (r,))]
    out = tuple(PagemapEntry(r.vaddr, r.nr_pages, PE_LAZY if lazy else PE_PRESENT) for lazy, r in pieces)
    return LazyLayout(
        entries=out,
        kept=tuple(r for lazy, r in pieces if not lazy),
        lazy=tuple(r for lazy, r in pieces if lazy),
    )


class RangeIndex:
    """The lazy ranges of the tasks of a dump, looked up by (task, address)."""

    def __init__(self, ranges: dict[int, Sequence[PageRange]]) -> None:
        self._ranges = {pid: sorted(rs, key=lambda r: r.vaddr) for pid, rs in ranges.items()}
        self._starts = {pid: [r.vaddr for r in rs] for pid, rs in self._ranges.items()}

    def find(self, dst_id: int, vaddr: int, nr_pages: int) -> tuple[int, int]:
        """(offset in the pages image, pages available there: <= nr_pages) for `vaddr`; KeyError if no
        lazy range of task `dst_id` holds it."""
        rs, starts = self._ranges.get(dst_id), self._starts.get(dst_id)
        if rs is None or starts is None:
            raise KeyError(f"no task {dst_id} in the dump")
        i = bisect.bisect_right(starts, vaddr) - 1
        if i < 0 or vaddr >= rs[i].end or vaddr % PAGE_SIZE:
            raise KeyError(f"task {dst_id} has no lazy page at {vaddr:#x}")
        r = rs[i]
        n = min(nr_pages, (r.end - vaddr) // PAGE_SIZE)
        return r.offset + (vaddr - r.vaddr), n

    def total_pages(self) -> int:
        return sum(r.nr_pages for rs in self._ranges.values() for r in rs)

    def ranges(self) -> dict[int, tuple[PageRange, ...]]:
        return {pid: tuple(rs) for pid, rs in self._ranges.items()}
