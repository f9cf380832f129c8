"""A lazy restore's pages, served from the snapshot's chunks in the registry (docs/lazy-restore.md).

The page server (shim/criu/pageserver.py) asks its PageSource for the pages of a task at an address; this
source finds them in the task's pages file (the lazy ranges of shim/criu/lazyimages.py map addresses to
offsets) and that offset in the chunks that tile the file (the config's ``containers[].pages[].chunks``).
A chunk is one zstd frame verified whole by its digest (docs/format.md), so the first request that falls
in a chunk downloads all of it, verified, opened and with its page delta applied exactly as staging does
(stream.chunk_content); later requests are answered from memory, and an answer never crosses a chunk's
end (the daemon asks again for the rest). Chunks are kept up to a byte budget, least recently used
first out, by content: two requests in one chunk, or in two places that hold the same chunk (a forked
worker's memory shared with its parent), download it once. Nothing is written to disk.

Memory is reused, not page-faulted in anew per chunk (the fill's CPU is what limits it on a small node:
bench/staging.py --modes lazy): download and decryption buffers go from one fetch to the next
(`from_registry`), and a chunk's buffer let go by the cache holds a later chunk once nothing serves from
it any more (`_Recycled`).

CRIU's daemon fills what no fault asked for in address order, a few MiB at a time, each request waiting
for the last: a chunk served is followed by the download of the next `readahead` chunks of its file in the
background (as far as the budget holds them beside it), so that the fill runs at the registry's parallel
download speed rather than at one chunk's round trip. A read-ahead that fails is forgotten: the request
that needs that chunk downloads it again and reports what fails.

Most used first: `warm(hot)` downloads the chunks holding the pages the container's processes asked for
first after their last lazy restore (the hot pages its layer holds, core/hotpages.py), in that order, up to
`hot_bytes`, before the restored process runs, and holds them apart from the cache until the daemon's
fill reaches them; the process's first faults are then answered from memory. The source records this
restore's faults for the next snapshot (`faults`): CRIU's daemon asks for exactly the faulting page, one
page, where its fill asks for at least 16 at a time (a fill of a lone page's range looks the same, and
is recorded too: a hint can afford it).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from kubectl_snapshot.core import hotpages
from kubectl_snapshot.core.chunks import Chunk, Delta, PagesFile
from kubectl_snapshot.core.hotpages import HotRange
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import Opener
from shim.criu.lazyimages import TaskLayout
from shim.criu.pageproto import PAGE_SIZE, RangeIndex
from shim.engine import stream
from shim.engine.node_ports import Registry

DEFAULT_CACHE_BYTES = 256 << 20  # 16 chunks of the largest span
DEFAULT_HOT_BYTES = 128 << 20  # what `warm` holds for the first faults: 8 chunks of the largest span

_Key = tuple[str, int, Delta | None]


def _key(c: Chunk) -> _Key:
    """A chunk's content: the same blob, length and page delta wherever it is (memory a forked worker
    shares with its parent is in both tasks' page files), kept and downloaded once."""
    return (c.digest, c.length, c.delta)


class ChunkPageSource:
    """A PageSource over the lazy ranges of `tasks`, read from the chunks of their pages files (`files`,
    by name: ``pages-<id>.img``); `fetch(chunk, what, scratch)` gives a chunk's `length` bytes (verified;
    more held past them are not the chunk's), in `scratch` where it can (a buffer the cache let go)."""

    def __init__(
        self,
        tasks: Mapping[int, TaskLayout],
        files: Mapping[str, PagesFile],
        fetch: Callable[[Chunk, str, bytearray], bytes | bytearray],
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        readahead: int = 0,
        hot_bytes: int = DEFAULT_HOT_BYTES,
    ) -> None:
        self._index = RangeIndex({pid: t.layout.lazy for pid, t in tasks.items()})
        self._file_of: dict[int, PagesFile] = {}
        for pid, t in tasks.items():
            name = f"pages-{t.pages_id}.img"
            pf = files.get(name)
            if pf is None:
                raise KeyError(f"task {pid}'s {name} is not among the snapshot's page files")
            self._file_of[pid] = pf
        self._files = dict(files)
        self._starts = {pf.name: [c.offset for c in pf.chunks] for pf in files.values()}
        self._fetch = fetch
        self._budget = cache_bytes
        self._cached: OrderedDict[_Key, tuple[bytes | bytearray, int]] = OrderedDict()
        self._free = _Recycled(max(2, readahead + 1))
        self._held = 0
        self._lock = threading.Lock()
        self._loading: dict[_Key, threading.Lock] = {}
        self.fetched = 0  # chunks downloaded (a chunk pushed out of the cache and asked again counts twice)
        self._readahead = max(0, readahead)
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: set[_Key] = set()  # read-aheads queued or running
        self._closed = False
        self._faults: list[tuple[int, int]] = []  # (pid, page) of one-page requests, in order
        # chunks `warm` fetched: held apart from the cache (its fill would push them out before the faults
        # they are for came) until the daemon's fill reaches them, then handed to the cache
        self._hot_budget = hot_bytes
        self._pinned: dict[_Key, tuple[bytes | bytearray, int]] = {}
        self._background: dict[_Key, int] = {}  # chunks read-ahead threads download: by their thread id

    def pages(self, dst_id: int, vaddr: int, nr_pages: int) -> bytes | bytearray | memoryview:
        offset, n = self._index.find(dst_id, vaddr, nr_pages)
        if nr_pages == 1 and len(self._faults) < hotpages.MAX_FAULTS:
            self._faults.append((dst_id, vaddr))  # list.append is atomic: no lock on the fault's path
        pf = self._file_of[dst_id]
        chunk = self._chunk_at(pf, offset)
        if nr_pages > 1 and self._pinned:
            self._unpin(_key(chunk))
        within = offset - chunk.offset
        n = min(n, (chunk.length - within) // PAGE_SIZE)
        if n < 1:
            raise OSError(f"{pf.name}: offset {offset} is not in a whole page of its chunk at {chunk.offset}")
        data = self._content(pf, chunk)
        self._read_ahead(pf, chunk)
        return memoryview(data)[within : within + n * PAGE_SIZE]

    def close(self) -> None:
        """Stop reading ahead (what runs ends on its own; its result is dropped)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            self._pinned.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def faults(self) -> list[tuple[int, int]]:
        """The (pid, page address) of each one-page request so far, in order: the restored processes' faults."""
        return list(self._faults)

    def warm(self, hot: Sequence[HotRange]) -> int:
        """Download, in the background and in `hot`'s order, the chunks that hold its pages, as far as
        `hot_bytes` go; they are kept until the daemon's fill reaches them (the faults they are for come
        first). Ranges of no lazy page are passed over. Returns how many chunks hold them (held already,
        or on their way)."""
        if not self._readahead:
            return 0
        picked: dict[_Key, tuple[PagesFile, Chunk]] = {}
        room = self._hot_budget
        for r in hot:
            pf = self._file_of.get(r.pid)
            addr, left = r.vaddr, r.pages
            while pf is not None and left > 0 and room > 0:
                try:
                    offset, n = self._index.find(r.pid, addr, left)
                except KeyError:
                    break  # not lazy (kept in the staged images) or not this dump's: nothing to fetch
                end = offset + n * PAGE_SIZE
                while offset < end and room > 0:
                    try:
                        chunk = self._chunk_at(pf, offset)
                    except OSError:  # chunks that do not tile the file: the request will say so, not a hint
                        break
                    if _key(chunk) not in picked:
                        picked[_key(chunk)] = (pf, chunk)
                        room -= chunk.length
                    offset = chunk.offset + chunk.length
                addr, left = addr + n * PAGE_SIZE, left - n
        with self._lock:
            for pf, chunk in picked.values():
                self._submit(pf, chunk, pin=True)  # those staging already read are held: not again
        return len(picked)

    def _read_ahead(self, pf: PagesFile, chunk: Chunk) -> None:
        if not self._readahead:
            return
        i = bisect.bisect_right(self._starts[pf.name], chunk.offset) - 1
        room = self._budget - chunk.length  # the chunk being served stays
        with self._lock:
            for nxt in pf.chunks[i + 1 : i + 1 + self._readahead]:
                room -= nxt.length
                if room < 0:
                    break
                self._submit(pf, nxt)

    def _submit(self, pf: PagesFile, chunk: Chunk, *, pin: bool = False) -> bool:
        """Queue `chunk`'s download unless it is held, coming, or the source closed (under the lock)."""
        key = _key(chunk)
        if self._closed or key in self._cached or key in self._pinned or key in self._ahead or key in self._loading:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self._readahead, thread_name_prefix="lazy-readahead", initializer=_in_the_background
            )
        self._ahead.add(key)
        self._pool.submit(self._fetch_ahead, pf, chunk, pin)
        return True

    def _unpin(self, key: _Key) -> None:
        """The daemon's fill reached a warmed chunk: the cache keeps it from here, as any other."""
        with self._lock:
            hit = self._pinned.pop(key, None)
            if hit is not None:
                self._keep(key, *hit)

    def _fetch_ahead(self, pf: PagesFile, chunk: Chunk, pin: bool = False) -> None:
        key = _key(chunk)
        _in_the_background()  # again: a request that waited for this thread's last download hurried it
        with self._lock:
            self._background[key] = threading.get_native_id()
        try:
            with contextlib.suppress(Exception):  # the request that needs it fetches it again and says why
                self._content(pf, chunk, pin=pin)
        finally:
            with self._lock:
                self._ahead.discard(key)
                self._background.pop(key, None)

    def _hurry(self, key: _Key) -> None:
        """A request waits for a chunk a read-ahead thread downloads: that thread gets the requester's
        priority until its download is done (else a fault would wait behind the node's other work)."""
        with self._lock:
            tid = self._background.get(key)
        if tid is not None:
            with contextlib.suppress(OSError):  # raising another thread's priority needs CAP_SYS_NICE (the agent's)
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def total_pages(self) -> int:
        return self._index.total_pages()

    def read(self, name: str, offset: int, length: int) -> bytearray:
        """`length` bytes of page file `name` at `offset`, across chunks (the pages a lazy restore keeps)."""
        pf = self._files.get(name)
        if pf is None:
            raise KeyError(f"{name} is not among the snapshot's page files")
        out = bytearray()
        while len(out) < length:
            at = offset + len(out)
            chunk = self._chunk_at(pf, at)
            within = at - chunk.offset
            take = min(length - len(out), chunk.length - within)
            out += memoryview(self._content(pf, chunk))[within : within + take]
        return out

    def _chunk_at(self, pf: PagesFile, offset: int) -> Chunk:
        i = bisect.bisect_right(self._starts[pf.name], offset) - 1
        if i < 0 or offset >= pf.chunks[i].offset + pf.chunks[i].length:
            raise OSError(f"{pf.name}: no chunk holds offset {offset}; the snapshot's chunks do not tile the file")
        return pf.chunks[i]

    def _content(self, pf: PagesFile, chunk: Chunk, *, pin: bool = False) -> bytes | bytearray:
        key = _key(chunk)
        with self._lock:
            hit = self._cached.get(key)
            if hit is not None:
                self._cached.move_to_end(key)
                return hit[0]
            hit = self._pinned.get(key)
            if hit is not None:
                return hit[0]
            loading = self._loading.setdefault(key, threading.Lock())
        if not loading.acquire(blocking=False):  # one download per chunk; the others wait for it
            self._hurry(key)
            loading.acquire()
        try:
            with self._lock:
                hit = self._cached.get(key) or self._pinned.get(key)
                if hit is not None:
                    return hit[0]
            data = self._fetch(chunk, pf.name, self._free.take(chunk.length + 1))
            if len(data) < chunk.length:
                raise OSError(f"{pf.name}: the chunk at {chunk.offset} gave {len(data)} bytes of {chunk.length}")
            with self._lock:
                self.fetched += 1
                if pin and not self._closed:
                    self._pinned[key] = (data, chunk.length)
                else:
                    self._keep(key, data, chunk.length)
                self._loading.pop(key, None)
            return data
        finally:
            loading.release()

    def _keep(self, key: _Key, data: bytes | bytearray, length: int) -> None:
        """Into the cache, the least recently used out past its budget (under the lock)."""
        self._cached[key] = (data, length)
        self._held += length
        while self._held > self._budget and len(self._cached) > 1:
            _gone, (old, n) = self._cached.popitem(last=False)
            self._held -= n
            self._free.give(old)


READAHEAD_NICE = 10  # a read-ahead thread's niceness: what the node runs at the default goes first


def _in_the_background() -> None:
    """The calling thread yields the CPU to the node's other work (on Linux a thread's niceness is its
    own): the read-ahead only fills ahead of the daemon, while the restored container's start, the
    kubelet noticing it, and the answers to its faults (the page server's own threads) wait for CPU. A
    fault that waits for a read-ahead's download lends that thread its priority (`_hurry`)."""
    with contextlib.suppress(OSError, AttributeError):  # lowering one's own priority needs no privilege
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READAHEAD_NICE)


class _Recycled:
    """Chunk buffers the cache let go, for the next downloads (at most `keep` of them). A buffer is handed
    out again only once nothing else refers to it: a page answer being sent is a view of it, and a view
    holds a reference to its buffer (CPython's reference count says so; where in doubt, a fresh one)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._bufs: list[bytearray] = []
        self._lock = threading.Lock()

    def give(self, buf: bytes | bytearray) -> None:
        if isinstance(buf, bytearray):
            with self._lock:
                self._bufs.append(buf)
                del self._bufs[: -self._keep]  # the oldest go (one of another chunk size is never taken)

    def take(self, need: int) -> bytearray:
        """A buffer for `need` bytes: one let go that nothing refers to, not much larger (the cache counts
        what its chunks hold, not their buffers' room), or a fresh one."""
        with self._lock:
            for i in range(len(self._bufs)):
                buf = self._bufs[i]
                if need <= len(buf) <= need + need // 4 and sys.getrefcount(buf) <= _UNSHARED:
                    del self._bufs[i]
                    return buf
                del buf
        return bytearray()


def _held_by_the_list_alone() -> int:
    """What sys.getrefcount says of a buffer held by a list and one local name only (3 on CPython)."""
    bufs = [bytearray()]
    buf = bufs[0]
    return sys.getrefcount(buf)


_UNSHARED = _held_by_the_list_alone()


KEEP_SCRATCH = 4  # download and decryption buffer sets kept between fetches (the read-ahead's 3 and a fault's)


def from_registry(
    registry: Registry, ref: Reference, opener: Opener | None = None
) -> Callable[[Chunk, str, bytearray], bytearray]:
    """The `fetch` of a ChunkPageSource over a snapshot in a registry (`opener`: a sealed snapshot's). Its
    download and decryption buffers are reused from fetch to fetch (at most KEEP_SCRATCH sets kept); the
    chunk's pages go into the `scratch` buffer it is given."""
    spare: list[dict[str, bytearray]] = []
    lock = threading.Lock()

    def fetch(chunk: Chunk, what: str, scratch: bytearray) -> bytearray:
        with lock:
            mine = spare.pop() if spare else {}

        def buffer(name: str) -> bytearray:
            return scratch if name == "raw" else mine.setdefault(name, bytearray())

        try:  # nothing returned refers to `mine`: the chunk is in `scratch` (or a delta's new buffer)
            data = stream.chunk_content(registry, ref, chunk, what=what, opener=opener, buffer=buffer)
        finally:
            with lock:
                if len(spare) < KEEP_SCRATCH:
                    spare.append(mine)
        return data if isinstance(data, bytearray) else bytearray(data)

    return fetch
