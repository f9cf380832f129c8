"""A dump's images made ready for a lazy restore, and the page source that serves the rest from the dump.

`prepare_lazy_images(dump, out)` writes the images a ``runc restore --lazy-pages`` (and the ``criu
lazy-pages`` daemon beside it) read: every image of `dump` as it is, except each task's pagemap, whose
lazy ranges (shim/criu/pageproto.lazy_layout: CRIU's own rule) are flagged PE_LAZY, and its pages image,
which keeps only the pages the restore itself writes (stacks, file-backed and shared mappings, ...).
What `out` leaves out is served by a page server from a `PageSource`: `ImagePageSource` reads it from
the dump's own pages images; a source over the registry's chunks takes its place where the pages were
never downloaded (docs/lazy-restore.md).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core.errors import FailedPrecondition
from shim.criu.images import _HINT_CORRUPT, _int, _load, _pycriu_images
from shim.criu.pageproto import (
    PAGE_SIZE,
    PE_PRESENT,
    LazyLayout,
    PagemapEntry,
    PageRange,
    ProtocolError,
    RangeIndex,
    Vma,
    lazy_layout,
)

_TASK_PAGEMAP = re.compile(r"pagemap-(\d+)\.img")
_PAGES = re.compile(r"pages-(\d+)\.img")


@dataclass(frozen=True)
class TaskLayout:
    pid: int
    pages_id: int
    layout: LazyLayout


@dataclass(frozen=True)
class LazyImages:
    """The restore's images (`images_dir`) and what its page server must serve (`tasks`)."""

    images_dir: str
    tasks: dict[int, TaskLayout]

    def index(self) -> RangeIndex:
        return RangeIndex({pid: t.layout.lazy for pid, t in self.tasks.items()})

    @property
    def lazy_bytes(self) -> int:
        return sum(t.layout.lazy_pages for t in self.tasks.values()) * PAGE_SIZE

    @property
    def kept_bytes(self) -> int:
        return sum(t.layout.kept_pages for t in self.tasks.values()) * PAGE_SIZE


def _stack_pointer(core: dict[str, Any]) -> int | None:
    """A thread's stack pointer in its core image (x86-64 and arm64; other architectures: None)."""
    for key in ("thread_info", "ti_aarch64"):
        ti = core.get(key)
        if isinstance(ti, dict) and isinstance(ti.get("gpregs"), dict):
            sp = ti["gpregs"].get("sp")
            return sp if isinstance(sp, int) else None
    return None


def read_task_layout(images: Any, dump: str, pid: int, threads: list[int]) -> TaskLayout | None:
    """One task's lazy layout from its mm, pagemap and cores; None for a task without memory (zombie)."""
    mm_path = os.path.join(dump, f"mm-{pid}.img")
    if not os.path.lexists(mm_path):
        return None
    vmas = [
        Vma(_int(v, "start", mm_path), _int(v, "end", mm_path), _int(v, "flags", mm_path), _int(v, "status", mm_path))
        for mm in _load(images, mm_path)
        for v in mm.get("vmas", [])
    ]
    pm_path = os.path.join(dump, f"pagemap-{pid}.img")
    pagemap = _load(images, pm_path)
    if not pagemap:
        raise FailedPrecondition(f"{pm_path} has no header", hint=_HINT_CORRUPT)
    entries = [
        PagemapEntry(
            _int(e, "vaddr", pm_path),
            _int(e, "nr_pages" if "nr_pages" in e else "compat_nr_pages", pm_path),  # CRIU < 4.2: u32 at 2
            _int(e, "flags", pm_path) if "flags" in e else PE_PRESENT,
        )
        for e in pagemap[1:]
    ]
    sps: list[int] = []
    for tid in threads:
        core_path = os.path.join(dump, f"core-{tid}.img")
        core = _load(images, core_path)
        sp = _stack_pointer(core[0]) if core else None
        if sp is None:
            raise FailedPrecondition(f"CRIU image {core_path} has no stack pointer this agent can read")
        sps.append(sp)
    try:
        layout = lazy_layout(vmas, entries, sps)
    except ProtocolError as e:
        raise FailedPrecondition(f"{pm_path}: {e}", hint="restore it eagerly (without --lazy)") from e
    return TaskLayout(pid=pid, pages_id=_int(pagemap[0], "pages_id", pm_path), layout=layout)


def read_lazy_layouts(dump: str) -> dict[int, TaskLayout]:
    images = _pycriu_images()
    pstree_path = os.path.join(dump, "pstree.img")
    tasks: dict[int, TaskLayout] = {}
    for entry in _load(images, pstree_path):
        pid = _int(entry, "pid", pstree_path)
        t = read_task_layout(images, dump, pid, [int(x) for x in entry.get("threads") or [pid]])
        if t is not None:
            tasks[pid] = t
    return tasks


def _copy_ranges(src_path: str, dst_path: str, ranges: tuple[PageRange, ...]) -> None:
    src = os.open(src_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(dst_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            for r in ranges:
                off, left = r.offset, r.nr_pages * PAGE_SIZE
                while left:
                    n = os.copy_file_range(src, dst, left, off)
                    if n <= 0:
                        raise FailedPrecondition(f"{src_path} ends before offset {off}", hint=_HINT_CORRUPT)
                    off, left = off + n, left - n
        finally:
            os.close(dst)
    finally:
        os.close(src)


def prepare_lazy_images(dump: str, out: str) -> LazyImages:
    """Write into the empty directory `out` the images of a lazy restore of `dump` (see the module)."""
    images = _pycriu_images()
    tasks = read_lazy_layouts(dump)
    rewritten = {f"pagemap-{pid}.img" for pid in tasks} | {f"pages-{t.pages_id}.img" for t in tasks.values()}
    for name in os.listdir(dump):
        path = os.path.join(dump, name)
        if name in rewritten or not os.path.isfile(path) or os.path.islink(path):
            continue
        shutil.copyfile(path, os.path.join(out, name), follow_symlinks=False)
    for pid, t in tasks.items():
        write_lazy_pagemap(images, os.path.join(dump, f"pagemap-{pid}.img"), os.path.join(out, f"pagemap-{pid}.img"), t)
        name = f"pages-{t.pages_id}.img"
        _copy_ranges(os.path.join(dump, name), os.path.join(out, name), t.layout.kept)
    return LazyImages(images_dir=out, tasks=tasks)


def write_lazy_pagemap(images: Any, src: str, dst: str, t: TaskLayout) -> None:
    """Task `t`'s pagemap `src` with its lazy ranges flagged PE_LAZY, written to the new file `dst`."""
    with open(src, "rb") as f:
        img = images.load(f)
    img["entries"] = [img["entries"][0]] + [
        # as CRIU 4.2 writes them, and readable by older ones (which know only compat_nr_pages)
        {
            "vaddr": e.vaddr,
            "compat_nr_pages": e.nr_pages if e.nr_pages < 1 << 32 else 0,
            "flags": e.flags,
            "nr_pages": e.nr_pages,
        }
        for e in t.layout.entries
    ]
    with open(dst, "xb") as f:
        images.dump(img, f)


class ImagePageSource:
    """A PageSource over the lazy ranges of a dump's own pages images (pages-<id>.img)."""

    def __init__(self, dump: str, tasks: dict[int, TaskLayout]) -> None:
        self._index = RangeIndex({pid: t.layout.lazy for pid, t in tasks.items()})
        self._fds: dict[int, int] = {}
        try:
            for pid, t in tasks.items():
                self._fds[pid] = os.open(
                    os.path.join(dump, f"pages-{t.pages_id}.img"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                )
        except OSError:
            self.close()
            raise

    def pages(self, dst_id: int, vaddr: int, nr_pages: int) -> bytes:
        offset, n = self._index.find(dst_id, vaddr, nr_pages)
        data = os.pread(self._fds[dst_id], n * PAGE_SIZE, offset)
        if len(data) != n * PAGE_SIZE:
            raise OSError(f"pages image of task {dst_id} ends at {offset + len(data)}, before {offset + n * PAGE_SIZE}")
        return data

    def total_pages(self) -> int:
        return self._index.total_pages()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def rewrite_for_lazy(
    checkpoint_dir: str, tasks: dict[int, TaskLayout], read: Callable[[str, int, int], bytes | bytearray]
) -> int:
    """Make the staged `checkpoint_dir`, whose pages files are not there, ready for a lazy restore: each
    task's pagemap rewritten in place (its lazy ranges flagged) and its pages file written with only the
    pages CRIU writes itself, read with `read(file name, offset, length)` (from the registry's chunks);
    returns the bytes written."""
    images = _pycriu_images()
    written = 0
    for pid, t in tasks.items():
        pm = os.path.join(checkpoint_dir, f"pagemap-{pid}.img")
        tmp = pm + ".lazy"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        write_lazy_pagemap(images, pm, tmp, t)
        os.replace(tmp, pm)
        name = f"pages-{t.pages_id}.img"
        fd = os.open(os.path.join(checkpoint_dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            for r in t.layout.kept:
                data = memoryview(read(name, r.offset, r.nr_pages * PAGE_SIZE))
                while data:
                    n = os.write(fd, data)
                    data, written = data[n:], written + n
        finally:
            os.close(fd)
    return written
