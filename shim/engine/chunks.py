"""Find the page files of a CRIU dump and where to cut them into chunks (see core/chunks.py for why).

Reads only CRIU's small pagemap images, with a minimal decoder of the two protobuf messages involved
(pycriu is not needed on the hot path, and a decoding problem only costs dedupe quality: the file is
then cut at fixed offsets, which is still a correct snapshot).
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from dataclasses import dataclass

from kubectl_snapshot.core.chunks import (
    MIN_SPAN,
    PAGE_SIZE,
    PagemapRun,
    Span,
    choose_span,
    plan_chunks,
    span_layouts,
)

IMG_COMMON_MAGIC = 0x54564319
PAGEMAP_MAGIC = 0x56084025
PE_PARENT = 1 << 0
PE_PRESENT = 1 << 2
MAX_PAGEMAP_BYTES = 64 << 20
# Page files smaller than this stay inside the container's tar layer: not worth a blob of their own.
MIN_CHUNKED_FILE = MIN_SPAN
_PAGEMAP_RE = re.compile(r"^pagemap-(?:shmem-)?\d+\.img$")
_PAGES_RE = re.compile(r"^pages-(\d+)\.img$")


@dataclass(frozen=True)
class PagesPlan:
    name: str  # pages-N.img
    path: str
    size: int
    spans: tuple[Span, ...]
    # per span: which virtual addresses its pages hold (core/chunks.span_layouts; empty when unknown:
    # no page delta) and keys naming the address windows it covers, the first page's first (where the
    # same range is found in the next dump, even if a small piece was merged in before it)
    layouts: tuple[bytes, ...] = ()
    keys: tuple[tuple[str, ...], ...] = ()

    def layout(self, i: int) -> tuple[tuple[str, ...], bytes]:
        return (self.keys[i], self.layouts[i]) if i < len(self.layouts) and self.layouts[i] else ((), b"")


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(msg: bytes) -> dict[int, int]:
    """Varint fields of a protobuf message (the pagemap messages hold nothing else)."""
    out: dict[int, int] = {}
    pos = 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            out[field], pos = _varint(msg, pos)
        elif wire == 2:
            n, pos = _varint(msg, pos)
            pos += n
        elif wire == 5:
            pos += 4
        elif wire == 1:
            pos += 8
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def read_pagemap(path: str) -> tuple[int, list[PagemapRun]]:
    """(pages_id, present runs in file order) of one pagemap-*.img."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_PAGEMAP_BYTES + 1)
    if len(data) > MAX_PAGEMAP_BYTES or len(data) < 8:
        raise ValueError("not a pagemap image")
    if struct.unpack_from("<II", data, 0) != (IMG_COMMON_MAGIC, PAGEMAP_MAGIC):
        raise ValueError("bad pagemap magic")
    pos = 8
    entries: list[dict[int, int]] = []
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + n > len(data):
            raise ValueError("truncated pagemap entry")
        entries.append(_fields(data[pos : pos + n]))
        pos += n
    if not entries or 1 not in entries[0]:
        raise ValueError("pagemap has no head")
    runs = []
    for e in entries[1:]:
        flags = e.get(4, PE_PRESENT)
        if not flags & PE_PRESENT or flags & PE_PARENT:
            continue
        nr = e.get(5) or e.get(2) or 0  # nr_pages (CRIU >= 3.x) or compat_nr_pages
        runs.append(PagemapRun(vaddr=e.get(1, 0), nr_pages=nr))
    return entries[0][1], runs


MAX_WINDOW_KEYS = 8


def window_keys(name: str, span: int, layout: bytes) -> tuple[str, ...]:
    """Names a chunk by its page file and the span-aligned address windows its pages cover (the first
    page's window first, at most MAX_WINDOW_KEYS): the chunk of the same range in the next dump shares
    one of them even if pages came or went or small pieces were merged differently."""
    windows: dict[int, None] = {}
    for k in range(0, len(layout) - 15, 16):
        vaddr, n = struct.unpack_from("<QQ", layout, k)
        for w in range(vaddr // span, (vaddr + n - 1) // span + 1):
            windows.setdefault(w, None)
            if len(windows) >= MAX_WINDOW_KEYS:
                break
        if len(windows) >= MAX_WINDOW_KEYS:
            break
    return tuple(hashlib.sha256(f"{name}\0{span}\0{w}".encode()).hexdigest()[:32] for w in windows)


def plan_checkpoint(checkpoint_dir: str, *, span: int | None = None) -> list[PagesPlan]:
    """Chunk plans for every page file of the dump that is worth chunking, in name order."""
    pages: dict[int, tuple[str, int]] = {}
    for name in os.listdir(checkpoint_dir):
        m = _PAGES_RE.match(name)
        if m:
            st = os.stat(os.path.join(checkpoint_dir, name), follow_symlinks=False)
            if st.st_size >= MIN_CHUNKED_FILE and st.st_size % PAGE_SIZE == 0:
                pages[int(m.group(1))] = (name, st.st_size)
    if not pages:
        return []
    runs: dict[int, list[PagemapRun] | None] = {}
    for name in sorted(os.listdir(checkpoint_dir)):
        if not _PAGEMAP_RE.match(name):
            continue
        try:
            pages_id, pm_runs = read_pagemap(os.path.join(checkpoint_dir, name))
        except (ValueError, OSError, struct.error):
            continue
        if pages_id in pages:
            # one pagemap per page file is what CRIU writes; two would make the address order unknown
            runs[pages_id] = None if pages_id in runs else pm_runs
    chosen = span or choose_span(sum(size for _, size in pages.values()))
    plans = []
    for pages_id in sorted(pages):
        name, size = pages[pages_id]
        pm_runs = runs.get(pages_id) or []
        spans = plan_chunks(pm_runs, size, chosen)
        layouts = span_layouts(pm_runs, size, spans) or []
        keys = tuple(window_keys(name, chosen, lay) for lay in layouts)
        plans.append(PagesPlan(name, os.path.join(checkpoint_dir, name), size, tuple(spans), tuple(layouts), keys))
    return plans
