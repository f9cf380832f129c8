"""Compress a dump's page chunks on an idle core while the rest of the dump still runs.

Why: CRIU under runc writes a process's pages first and then spends tens of ms more on the container
(its mounts, namespaces, the network unlock, runc's own work: docs/performance.md, "Where the freeze
goes"), mostly on one core, while the other core waits. A small pod's checkpoint was half packaging
after the thaw; compressing the chunks of page files that are already final during that tail takes
the largest CPU part of the packaging out of it.

What makes it safe:
- A page file is used only once inotify reported both it and its pagemap closed after writing
  (shim/closewatch.py): CRIU opens every image once and never writes it again. A lost event (queue
  overflow) stops the work.
- The work runs in one thread under SCHED_IDLE: it gets a core only when nothing else wants it, so it
  does not lengthen the freeze; `stop` restores the normal policy before waiting for the chunk in hand
  (a thawed workload that keeps both cores busy would otherwise starve it).
- A result is only a cache: packaging takes it for exactly the same page file (device, inode, size,
  modification and change times), offset and length, and compresses anything else itself. The
  blob's digest is still computed from the bytes that are sent; nothing here is trusted by a restore.
- Bounded: at most AHEAD_BUDGET compressed bytes are kept; beyond it the rest is left to packaging.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass

from shim.closewatch import CloseWatch
from shim.engine.chunks import plan_checkpoint, read_pagemap
from shim.engine.stream import compress_chunk

log = logging.getLogger(__name__)

AHEAD_BUDGET = 96 << 20  # compressed bytes held for packaging (the chunk workers hold up to 128 MiB)
_PAGES_RE = re.compile(r"^pages-(\d+)\.img$")
_PAGEMAP_RE = re.compile(r"^pagemap-(?:shmem-)?\d+\.img$")
_POLL_S = 0.02

FileId = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def file_id(st: os.stat_result) -> FileId:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Packed:
    data: bytes  # the chunk compressed as packaging would (shim/engine/stream.compress_chunk)
    sha256: bytes  # of `data`
    source: FileId


class PackAhead:
    """One container's dump directory, watched from before CRIU starts until `stop`."""

    def __init__(self, checkpoint_dir: str, *, budget: int = AHEAD_BUDGET) -> None:
        self._dir = checkpoint_dir
        self._budget = budget
        self._held = 0
        self._watch = CloseWatch(checkpoint_dir)  # OSError: no inotify here; the caller does without
        self._done: dict[tuple[str, int, int], Packed] = {}
        self._stop = threading.Event()
        self._tid: int | None = None
        self._thread = threading.Thread(target=self._run, name="pack-ahead", daemon=True)
        self.chunks = 0  # compressed ahead (for the timings)
        self.used = 0  # taken by packaging

    @classmethod
    def start(cls, checkpoint_dir: str, *, budget: int = AHEAD_BUDGET) -> PackAhead | None:
        """Watch `checkpoint_dir` (must exist, before CRIU writes into it); None where inotify is unavailable."""
        try:
            ahead = cls(checkpoint_dir, budget=budget)
        except OSError as exc:
            log.info("no packing ahead for %s: %s", checkpoint_dir, exc)
            return None
        ahead._thread.start()
        return ahead

    def stop(self) -> None:
        """No new chunk is started; the one in hand is finished at normal priority; idempotent."""
        self._stop.set()
        tid = self._tid
        if tid is not None and self._thread.is_alive():
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        if self._thread.is_alive():
            self._thread.join()
        self._watch.close()

    def take(self, name: str, offset: int, length: int, fd: int) -> Packed | None:
        """The chunk compressed ahead, if it was and from the very file open as `fd`; only after `stop`."""
        if not self._stop.is_set():
            raise RuntimeError("PackAhead.take before stop")
        got = self._done.pop((name, offset, length), None)
        if got is None or got.source != file_id(os.fstat(fd)):
            return None
        self.used += 1
        return got

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        closed: set[str] = set()
        pending: dict[str, str] = {}  # page file -> its pagemap, both seen closed, not yet packed
        try:
            while not self._stop.is_set():
                names = self._watch.wait(_POLL_S)
                if self._watch.overflowed:
                    return
                for name in names:
                    closed.add(name)
                    if _PAGEMAP_RE.match(name):
                        with contextlib.suppress(OSError, ValueError):
                            pages_id, _ = read_pagemap(os.path.join(self._dir, name))
                            pending[f"pages-{pages_id}.img"] = name
                for pages in [p for p in pending if p in closed]:
                    del pending[pages]
                    if not self._pack_file(pages):
                        return
        except Exception:  # a cache: packaging does everything itself when this stops early
            log.exception("packing ahead in %s stopped", self._dir)

    def _pack_file(self, name: str) -> bool:
        """Compress the chunks of one final page file; False once the budget is spent or stopped."""
        plan = next((p for p in plan_checkpoint(self._dir) if p.name == name), None)
        if plan is None:  # too small for chunks (stays in the layer), or not a page file after all
            return True
        fd = os.open(plan.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            source = file_id(os.fstat(fd))
            for span in plan.spans:
                if self._stop.is_set() or self._held >= self._budget:
                    return False
                raw = os.pread(fd, span.length, span.offset)
                if len(raw) != span.length:
                    return False
                data = compress_chunk(raw)
                self._done[(name, span.offset, span.length)] = Packed(data, hashlib.sha256(data).digest(), source)
                self._held += len(data)
                self.chunks += 1
        finally:
            os.close(fd)
        return True
