"""A lazy restore's pages served from a snapshot's chunks (shim/engine/lazysource.py): the bytes are the
page file's, as staging would write it; an answer ends at its chunk's end; a chunk is downloaded once
however many requests fall in it (at once too), and again only after the cache let it go; what is not a
lazy page is refused as the page server expects; a chunk in two places is downloaded once; a buffer is reused
only once no answer views it. Through the page server: one test. With real CRIU:
tests/integration/test_lazy_restore.py (a dump's own pages image as the source)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kubectl_snapshot.core.chunks import PAGE_SIZE, Chunk, PagesFile
from kubectl_snapshot.core.errors import DigestMismatch
from kubectl_snapshot.core.hotpages import HotRange
from kubectl_snapshot.core.reference import Reference
from shim.criu import pageproto as pp
from shim.criu.lazyimages import TaskLayout
from shim.criu.pageproto import LazyLayout, PageRange
from shim.criu.pageserver import PageServer
from shim.engine import stream
from shim.engine.lazysource import READAHEAD_NICE, ChunkPageSource, _Recycled, from_registry

P = PAGE_SIZE
REF = Reference.parse("reg.example/ns/app@sha256:" + "0" * 64)
HEAP = 0x7F0000000000


class Blobs:
    """A registry's blob reads (digest -> bytes), counted; `slow` holds each read that long."""

    def __init__(self, blobs: dict[str, bytes], slow: float = 0.0) -> None:
        self.blobs, self.slow = blobs, slow
        self.fetched: list[str] = []

    def fetch_blob(self, ref: object, digest: str, out: Any, **_: Any) -> int:
        self.fetched.append(digest)
        time.sleep(self.slow)
        out.write(self.blobs[digest])
        return len(self.blobs[digest])


def chunked(raw: bytes, span: int) -> tuple[PagesFile, dict[str, bytes]]:
    """pages-1.img of `raw`, in chunks of `span` bytes, and their blobs."""
    chunks, blobs = [], {}
    for off in range(0, len(raw), span):
        z = zstandard.ZstdCompressor(level=1).compress(raw[off : off + span])
        d = "sha256:" + hashlib.sha256(z).hexdigest()
        blobs[d] = z
        chunks.append(Chunk(off, len(raw[off : off + span]), d, len(z)))
    return PagesFile("pages-1.img", len(raw), tuple(chunks)), blobs


def task(*ranges: PageRange) -> dict[int, TaskLayout]:
    return {1: TaskLayout(pid=1, pages_id=1, layout=LazyLayout(entries=(), kept=(), lazy=ranges))}


RAW = os.urandom(24 * P)  # the page file: 3 chunks of 8 pages
# task 1's lazy pages: 4 pages at HEAP (file pages 2-5), 16 at HEAP + 1 MiB (file pages 6-21)
LAZY = (PageRange(HEAP, 4, 2 * P), PageRange(HEAP + (1 << 20), 16, 6 * P))


def source(blobs: Blobs, pf: PagesFile, **kw: Any) -> ChunkPageSource:
    return ChunkPageSource(task(*LAZY), {pf.name: pf}, from_registry(blobs, REF), **kw)  # type: ignore[arg-type]


def test_pages_are_the_page_files_bytes_and_an_answer_ends_at_its_chunks_end(tmp_path: Path) -> None:
    pf, z = chunked(RAW, 8 * P)
    blobs = Blobs(z)
    src = source(blobs, pf)
    # what staging writes is what the source serves
    stream.fetch_chunks(Blobs(z), REF, [pf], str(tmp_path))  # type: ignore[arg-type]
    staged = (tmp_path / "pages-1.img").read_bytes()
    assert staged == RAW
    assert bytes(src.pages(1, HEAP, 4)) == staged[2 * P : 6 * P]
    assert bytes(src.pages(1, HEAP + P, 2)) == staged[3 * P : 5 * P]
    # file pages 6-21 span three chunks: each answer stops at a chunk's end, the daemon asks again
    second = HEAP + (1 << 20)
    assert bytes(src.pages(1, second, 16)) == staged[6 * P : 8 * P]
    assert bytes(src.pages(1, second + 2 * P, 14)) == staged[8 * P : 16 * P]
    assert bytes(src.pages(1, second + 10 * P, 6)) == staged[16 * P : 22 * P]
    assert sorted(blobs.fetched) == sorted(z)  # three chunks, each downloaded once for five requests
    assert src.fetched == 3 and src.total_pages() == 20


def test_what_is_not_a_lazy_page_is_refused_as_the_page_server_expects() -> None:
    pf, z = chunked(RAW, 8 * P)
    src = source(Blobs(z), pf)
    for dst, vaddr in ((1, HEAP + 4 * P), (1, HEAP - P), (2, HEAP), (1, HEAP + 1)):
        with pytest.raises(KeyError):
            src.pages(dst, vaddr, 1)
    with pytest.raises(KeyError, match=r"pages-9\.img"):  # a task whose pages file the snapshot lacks
        ChunkPageSource(
            {1: TaskLayout(pid=1, pages_id=9, layout=LazyLayout((), (), LAZY))}, {pf.name: pf}, lambda c, w, s: b""
        )


def test_a_chunk_the_cache_let_go_is_downloaded_again_and_a_kept_one_is_not() -> None:
    pf, z = chunked(RAW, 8 * P)
    blobs = Blobs(z)
    src = source(blobs, pf, cache_bytes=8 * P)  # room for one chunk
    second = HEAP + (1 << 20)
    src.pages(1, second, 1)  # chunk 0
    src.pages(1, second + 2 * P, 1)  # chunk 1: chunk 0 goes
    src.pages(1, second + 3 * P, 1)  # chunk 1 again: kept
    src.pages(1, second, 1)  # chunk 0 again: downloaded again
    assert src.fetched == 3 and len(blobs.fetched) == 3


def test_requests_in_one_chunk_at_once_download_it_once() -> None:
    pf, z = chunked(RAW, 8 * P)
    blobs = Blobs(z, slow=0.2)
    src = source(blobs, pf)
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda i=i: got.append(bytes(src.pages(1, HEAP + i * P, 1)))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(got) == sorted(RAW[(2 + i) * P : (3 + i) * P] for i in range(4))
    assert len(blobs.fetched) == 1


def test_a_chunk_that_is_not_what_its_digest_says_is_an_error_and_not_kept() -> None:
    pf, z = chunked(RAW, 8 * P)
    first = pf.chunks[0].digest
    bad = dict(z)
    bad[first] = b"not zstd"
    src = source(Blobs(bad), pf)
    with pytest.raises(DigestMismatch):
        src.pages(1, HEAP, 1)
    with pytest.raises(DigestMismatch):  # asked again (the page server retries): fetched again, refused again
        src.pages(1, HEAP, 1)
    assert src.fetched == 0


def test_the_page_server_serves_a_task_from_the_chunks() -> None:
    pf, z = chunked(RAW, 8 * P)
    server, theirs = PageServer.over_socketpair(source(Blobs(z), pf), criu_version="4.2.1")
    server.start()
    layout = pp.LAYOUT_32
    with theirs:
        second = HEAP + (1 << 20)
        theirs.sendall(pp.get_request(1, second, 16).encode(layout))
        reply = pp.decode_iov(_recv(theirs, layout.size), layout)
        assert reply == pp.Iov(pp.PS_IOV_ADD_F, 2, second, 1, flags=pp.PE_PRESENT)  # up to chunk 0's end
        assert _recv(theirs, 2 * P) == RAW[6 * P : 8 * P]
        theirs.sendall(pp.Iov(pp.PS_IOV_FORCE_CLOSE).encode(layout))
        assert _recv(theirs, 4) == pp.close_reply(0)
    stats = server.wait(5)
    assert stats.error is None and stats.pages == 2


def _recv(s: Any, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            break
        buf += part
    return buf


def _wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_chunks_after_one_served_are_read_ahead_within_the_budget() -> None:
    raw = os.urandom(48 * P)  # six chunks of 8 pages; one lazy range over all of it
    pf, z = chunked(raw, 8 * P)
    blobs = Blobs(z)
    src = ChunkPageSource(task(PageRange(HEAP, 48, 0)), {pf.name: pf}, from_registry(blobs, REF),  # type: ignore[arg-type]
                          cache_bytes=3 * 8 * P, readahead=4)  # fmt: skip
    try:
        assert bytes(src.pages(1, HEAP, 8)) == raw[: 8 * P]
        # chunks 1 and 2 come in the background: the budget holds two beside the one served, not four
        _wait(lambda: src.fetched == 3, "the read-ahead")
        time.sleep(0.1)
        # the background fetches run side by side: which chunks came matters, not their order
        assert src.fetched == 3 and blobs.fetched[0] == pf.chunks[0].digest
        assert sorted(blobs.fetched) == sorted(c.digest for c in pf.chunks[:3])
        # served from memory: no download for the next two chunks
        assert bytes(src.pages(1, HEAP + 8 * P, 8)) == raw[8 * P : 16 * P]
        assert bytes(src.pages(1, HEAP + 16 * P, 8)) == raw[16 * P : 24 * P]
        _wait(lambda: src.fetched == 5, "the read-ahead of chunks 3 and 4")
        # the last chunk: nothing after it to read
        assert bytes(src.pages(1, HEAP + 40 * P, 8)) == raw[40 * P :]
        assert src.fetched == 6 and sorted(blobs.fetched) == sorted(z)
    finally:
        src.close()


class Damaged(Blobs):
    """A registry whose blob `bad` fails its digest check (as the registry client reports it)."""

    def __init__(self, blobs: dict[str, bytes], bad: str) -> None:
        super().__init__(blobs)
        self.bad = bad

    def fetch_blob(self, ref: object, digest: str, out: Any, **kw: Any) -> int:
        if digest == self.bad:
            self.fetched.append(digest)
            raise DigestMismatch(f"fetch blob {digest}: content does not match its digest")
        return super().fetch_blob(ref, digest, out, **kw)


def test_a_read_ahead_that_fails_is_forgotten_and_the_request_says_why() -> None:
    raw = os.urandom(16 * P)
    pf, z = chunked(raw, 8 * P)
    blobs = Damaged(z, pf.chunks[1].digest)
    src = ChunkPageSource(task(PageRange(HEAP, 16, 0)), {pf.name: pf}, from_registry(blobs, REF),  # type: ignore[arg-type]
                          readahead=2)  # fmt: skip
    try:
        assert bytes(src.pages(1, HEAP, 8)) == raw[: 8 * P]
        time.sleep(0.2)  # the read-ahead of chunk 1 failed, silently
        assert blobs.fetched == [pf.chunks[0].digest, pf.chunks[1].digest]
        with pytest.raises(DigestMismatch):
            src.pages(1, HEAP + 8 * P, 8)  # the request downloads it again and says why
        assert blobs.fetched[2:] == [pf.chunks[1].digest]
    finally:
        src.close()


def test_a_buffer_the_cache_let_go_holds_a_later_chunk_only_once_no_answer_views_it() -> None:
    pf, z = chunked(RAW, 8 * P)
    given: list[int] = []  # the room of the buffer each fetch was given: 0 for a fresh one
    inner = from_registry(Blobs(z), REF)  # type: ignore[arg-type]

    def fetch(c: Chunk, what: str, scratch: bytearray) -> bytearray:
        given.append(len(scratch))
        return inner(c, what, scratch)

    src = ChunkPageSource(task(*LAZY), {pf.name: pf}, fetch, cache_bytes=8 * P)  # room for one chunk
    second = HEAP + (1 << 20)
    held = src.pages(1, second, 2)  # chunk 0, its answer still being sent
    answer = src.pages(1, second + 2 * P, 1)  # chunk 1: chunk 0 goes out of the cache, still viewed
    assert bytes(answer) == RAW[8 * P : 9 * P]
    del answer
    answer = src.pages(1, second + 10 * P, 1)  # chunk 2: chunk 0's buffer is still viewed: a fresh one
    assert bytes(answer) == RAW[16 * P : 17 * P]
    del answer
    assert bytes(held) == RAW[6 * P : 8 * P]  # untouched
    # chunk 0 again: into the buffer chunk 1 had (nothing views it); the viewed one is still not used
    assert bytes(src.pages(1, second, 2)) == RAW[6 * P : 8 * P]
    assert given == [0, 0, 0, 8 * P + 1]
    assert bytes(held) == RAW[6 * P : 8 * P]
    assert src.fetched == 4


def test_a_chunk_two_tasks_share_is_downloaded_once_and_served_to_both() -> None:
    # a forked worker's memory shared with its parent: the same chunks in both tasks' page files
    raw = os.urandom(16 * P) + os.urandom(8 * P)
    pf1, z = chunked(raw, 8 * P)
    pf2 = PagesFile("pages-2.img", 16 * P, pf1.chunks[:2])  # the child's: the parent's first two chunks
    tasks = {
        1: TaskLayout(pid=1, pages_id=1, layout=LazyLayout((), (), (PageRange(HEAP, 24, 0),))),
        2: TaskLayout(pid=2, pages_id=2, layout=LazyLayout((), (), (PageRange(HEAP, 16, 0),))),
    }
    blobs = Blobs(z)
    src = ChunkPageSource(tasks, {pf1.name: pf1, pf2.name: pf2}, from_registry(blobs, REF))  # type: ignore[arg-type]
    assert bytes(src.pages(1, HEAP, 8)) == raw[: 8 * P]
    assert bytes(src.pages(2, HEAP, 8)) == raw[: 8 * P]
    assert bytes(src.pages(2, HEAP + 8 * P, 8)) == raw[8 * P : 16 * P]
    assert bytes(src.pages(1, HEAP + 8 * P, 16)) == raw[8 * P : 16 * P]
    assert bytes(src.pages(1, HEAP + 16 * P, 8)) == raw[16 * P :]
    assert blobs.fetched == [c.digest for c in pf1.chunks] and src.fetched == 3


def test_a_buffer_let_go_is_taken_only_for_a_chunk_of_about_its_size() -> None:
    free = _Recycled(keep=2)
    free.give(bytearray(100))
    assert len(free.take(10)) == 0  # much larger than asked: a fresh one (the cache counts pages, not room)
    assert len(free.take(101)) == 0  # too small
    assert len(free.take(90)) == 100
    assert len(free.take(90)) == 0  # taken once
    for n in (200, 300, 400):
        free.give(bytearray(n))
    assert len(free.take(200)) == 0 and len(free.take(400)) == 400  # the oldest went


def test_the_download_buffer_goes_from_one_fetch_to_the_next() -> None:
    bufs: list[bytearray] = []  # held here: a fresh buffer cannot take a freed one's id

    class Seen(Blobs):
        def fetch_blob(self, ref: object, digest: str, out: Any, **kw: Any) -> int:
            bufs.append(out.buf)
            return super().fetch_blob(ref, digest, out, **kw)

    pf, z = chunked(RAW, 8 * P)
    fetch = from_registry(Seen(z), REF)  # type: ignore[arg-type]
    got = [bytes(fetch(c, pf.name, bytearray())[: c.length]) for c in pf.chunks]
    assert b"".join(got) == RAW
    assert len(bufs) == 3 and all(b is bufs[0] for b in bufs)


def test_the_read_ahead_runs_behind_the_nodes_other_work() -> None:
    nice: dict[str, int] = {}

    class Seen(Blobs):
        def fetch_blob(self, ref: object, digest: str, out: Any, **kw: Any) -> int:
            nice[digest] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return super().fetch_blob(ref, digest, out, **kw)

    raw = os.urandom(16 * P)
    pf, z = chunked(raw, 8 * P)
    src = ChunkPageSource(task(PageRange(HEAP, 16, 0)), {pf.name: pf}, from_registry(Seen(z), REF),  # type: ignore[arg-type]
                          readahead=1)  # fmt: skip
    try:
        assert bytes(src.pages(1, HEAP, 8)) == raw[: 8 * P]
        _wait(lambda: src.fetched == 2, "the read-ahead")
    finally:
        src.close()
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    asked, ahead = (nice[c.digest] for c in pf.chunks)
    assert asked == ours and ahead == min(19, ours + READAHEAD_NICE)


@pytest.mark.skipif(os.geteuid() != 0, reason="raising another thread's priority needs CAP_SYS_NICE, as the agent has")
def test_a_fault_waiting_for_a_read_ahead_hurries_that_thread_and_the_next_read_ahead_runs_behind_again() -> None:
    """A fault on a chunk a niced read-ahead thread is downloading would wait behind the node's other
    work: the thread gets the fault's priority for that download, then is niced again for the next."""
    nice: dict[str, int] = {}
    started = threading.Event()

    class Slow(Blobs):
        def fetch_blob(self, ref: object, digest: str, out: Any, **kw: Any) -> int:
            started.set()
            time.sleep(0.3)  # meanwhile the request comes and waits
            nice[digest] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return super().fetch_blob(ref, digest, out, **kw)

    pf, z = chunked(RAW, 8 * P)
    src = source(Slow(z), pf, readahead=1)
    second = HEAP + (1 << 20)
    try:
        assert src.warm((HotRange(1, second + 12 * P, 1), HotRange(1, HEAP, 1))) == 2  # chunks 2, then 0
        assert started.wait(5)
        assert bytes(src.pages(1, second + 12 * P, 1)) == RAW[18 * P : 19 * P]  # waits for the first
        _wait(lambda: src.fetched == 2, "the second warm download")
    finally:
        src.close()
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert nice[pf.chunks[2].digest] == ours  # hurried while the fault waited
    assert nice[pf.chunks[0].digest] == READAHEAD_NICE  # nobody waited: behind again


def _settled(src: ChunkPageSource, n: int) -> None:
    deadline = time.monotonic() + 10
    while src.fetched < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_warm_fetches_the_chunks_of_the_hot_pages_first_in_their_order() -> None:
    """The hot pages a layer holds (core/hotpages.py): the chunks that hold them are downloaded before any
    request, in the list's order; the requests that follow are answered from memory."""
    pf, z = chunked(RAW, 8 * P)
    blobs = Blobs(z)
    src = source(blobs, pf, readahead=1)  # one read-ahead thread: the downloads' order is the list's
    second = HEAP + (1 << 20)
    # file page 18 (third chunk), then page 3 (first chunk), then page 3 again (already picked)
    hot = (HotRange(1, second + 12 * P, 1), HotRange(1, HEAP + P, 2), HotRange(1, HEAP + P, 1))
    assert src.warm(hot) == 2
    _settled(src, 2)
    assert blobs.fetched == [pf.chunks[2].digest, pf.chunks[0].digest]
    assert bytes(src.pages(1, second + 12 * P, 1)) == RAW[18 * P : 19 * P]
    assert bytes(src.pages(1, HEAP + P, 1)) == RAW[3 * P : 4 * P]
    assert src.fetched == 2  # answered from what was warmed
    src.close()


def test_warm_counts_a_chunk_staging_already_read_and_does_not_download_it_again() -> None:
    pf, z = chunked(RAW, 8 * P)
    blobs = Blobs(z)
    src = source(blobs, pf, readahead=1)
    src.read(pf.name, 0, P)  # staging reads the pages CRIU writes itself: chunk 0
    assert src.warm((HotRange(1, HEAP + P, 1),)) == 1  # file page 3: chunk 0, held
    time.sleep(0.1)
    assert blobs.fetched == [pf.chunks[0].digest]
    src.close()


def test_warm_passes_over_what_is_not_a_lazy_page_of_this_dump_and_the_restore_goes_on() -> None:
    """A list that names other pids or addresses (a pod whose memory moved since, a stale list) warms
    nothing for them and fails nothing: the legitimate requests are served as without a list."""
    pf, z = chunked(RAW, 8 * P)
    blobs = Blobs(z)
    src = source(blobs, pf, readahead=2)
    stale = (HotRange(7, HEAP, 4), HotRange(1, HEAP + (64 << 20), 3), HotRange(1, HEAP - P, 1))
    assert src.warm(stale) == 0
    assert bytes(src.pages(1, HEAP, 4)) == RAW[2 * P : 6 * P]
    src.close()


def test_warm_stops_at_its_budget_and_holds_what_it_fetched_until_the_fill_reaches_it() -> None:
    """Warmed chunks are kept apart from the cache, whose fill would push them out before the faults they
    are for came; the fill's first request in one hands it to the cache."""
    pf, z = chunked(RAW, 8 * P)
    blobs = Blobs(z)
    src = source(blobs, pf, readahead=1, cache_bytes=8 * P, hot_bytes=16 * P)  # a cache of one chunk
    second = HEAP + (1 << 20)
    hot = (HotRange(1, second + 12 * P, 1), HotRange(1, second + 4 * P, 1), HotRange(1, HEAP, 1))
    assert src.warm(hot) == 2  # file pages 18 and 10: chunks 2 and 1; chunk 0 is past the budget
    _settled(src, 2)
    src.pages(1, HEAP, 4)  # the fill, in chunk 0: the cache's one chunk
    assert bytes(src.pages(1, second + 12 * P, 1)) == RAW[18 * P : 19 * P]  # faults: still held
    assert bytes(src.pages(1, second + 4 * P, 1)) == RAW[10 * P : 11 * P]
    assert src.fetched == 3
    src.pages(1, second + 2 * P, 6)  # the fill reaches chunk 1: the cache's now, chunk 0 goes
    src.pages(1, HEAP, 4)
    assert src.fetched == 4
    src.pages(1, second + 10 * P, 6)  # chunk 2 too, and chunk 0 goes again
    src.pages(1, second + 2 * P, 6)  # chunk 1 was pushed out by it
    assert src.fetched == 5
    src.close()


def test_the_faults_are_the_one_page_requests_in_their_order() -> None:
    """CRIU's daemon asks for exactly the faulting page; its fill asks for more at once."""
    pf, z = chunked(RAW, 8 * P)
    src = source(Blobs(z), pf)
    second = HEAP + (1 << 20)
    src.pages(1, second + 3 * P, 1)
    src.pages(1, HEAP, 4)  # the fill
    src.pages(1, HEAP + 2 * P, 1)
    src.pages(1, second + 4 * P, 1)
    assert src.faults() == [(1, second + 3 * P), (1, HEAP + 2 * P), (1, second + 4 * P)]
