"""Which of a container's pages its processes asked for first: the order a lazy restore fetches them in.

A lazily restored process faults on the pages it touches, one at a time, in the order it touches them
(CRIU's lazy-pages daemon asks the page server for exactly the faulting page; its background fill asks
for more at once, in address order). The agent records that order while it serves a lazy restore and
puts it in the container's next snapshot, as a file of the container's layer (``kubectl-snapshot.hotpages.json``,
docs/format.md: sealed with the layer, since its addresses tell how the processes' memory is laid out):
the next lazy restore of the pod fetches the chunks holding those pages first, before the restored process
runs, so that its first faults are answered from memory instead of each waiting for a chunk's download.

It is a hint, never content: a page's bytes still come from its verified chunk. A list that does not
parse is dropped whole (the restore reads in file order, as without one); it never fails a restore.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PAGE = 4096
MAX_RANGES = 1024  # ranges kept per container (about 30 KiB of config JSON at most)
MAX_RANGE_PAGES = 1 << 18  # 1 GiB: a longer range is not a page's working set
MAX_FAULTS = 1 << 16  # faults recorded per lazy restore, before they are merged into ranges
MAX_FILE_BYTES = 256 << 10  # the layer's file, read at most this long


@dataclass(frozen=True)
class HotRange:
    """`pages` pages of task `pid`'s memory from `vaddr` (page aligned), asked for in this order."""

    pid: int
    vaddr: int
    pages: int

    @property
    def end(self) -> int:
        return self.vaddr + self.pages * PAGE

    def covers(self, other: HotRange) -> bool:
        return other.pid == self.pid and self.vaddr <= other.vaddr and other.end <= self.end


def from_faults(faults: Iterable[tuple[int, int]], limit: int = MAX_RANGES) -> tuple[HotRange, ...]:
    """Faults as (pid, page address), in the order they came, as ranges in first-touch order: a fault
    on the page right after the last range's end (a sequential walk) extends that range."""
    out: list[HotRange] = []
    seen: set[tuple[int, int]] = set()
    for pid, addr in faults:
        addr -= addr % PAGE
        if (pid, addr) in seen:
            continue
        seen.add((pid, addr))
        last = out[-1] if out else None
        if last is not None and last.pid == pid and last.end == addr and last.pages < MAX_RANGE_PAGES:
            out[-1] = HotRange(pid, last.vaddr, last.pages + 1)
            continue
        if len(out) >= limit:
            break
        out.append(HotRange(pid, addr, 1))
    return tuple(out)


def merge(first: Sequence[HotRange], then: Sequence[HotRange], limit: int = MAX_RANGES) -> tuple[HotRange, ...]:
    """`first` (this restore's faults), then what `then` (the snapshot's own list) adds beyond them:
    pages used before and not yet asked for this time still come early next time."""
    out = list(first[:limit])
    for r in then:
        if len(out) >= limit:
            break
        if not any(k.covers(r) for k in out):
            out.append(r)
    return tuple(out)


def to_bytes(ranges: Sequence[HotRange]) -> bytes:
    """The layer file: ``{"version": 1, "ranges": [[pid, vaddr, pages], ...]}``."""
    return json.dumps({"version": 1, "ranges": [[r.pid, r.vaddr, r.pages] for r in ranges]}).encode()


def from_bytes(data: bytes) -> tuple[HotRange, ...]:
    """The layer file's ranges; () where it is not as `to_bytes` writes it (a hint: never an error)."""
    if len(data) > MAX_FILE_BYTES:
        return ()
    try:
        doc = json.loads(data)
    except ValueError:
        return ()
    if not isinstance(doc, dict) or doc.get("version") != 1:
        return ()
    return parse(doc.get("ranges"))


def parse(raw: Any) -> tuple[HotRange, ...]:
    """``[[pid, vaddr, pages], ...]``; () where not as written above (a hint: never an error)."""
    if not isinstance(raw, list) or len(raw) > MAX_RANGES:
        return ()
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and all(type(x) is int for x in item)):
            return ()
        pid, vaddr, pages = item
        if pid < 1 or vaddr < 0 or vaddr % PAGE or vaddr >= 1 << 64 or not 1 <= pages <= MAX_RANGE_PAGES:
            return ()
        out.append(HotRange(pid, vaddr, pages))
    return tuple(out)
