"""Lazy restore with real runc and CRIU (issue 44, item 2): ``runc restore --lazy-pages`` beside
``criu lazy-pages --page-server`` served by the agent's PageServer from the dump's pages.

A container holding 128 MiB of a known pattern is checkpointed once (plain ``runc checkpoint``); each test
restores it. Also what CRIU does when the pages stop coming, which the page server's failure handling is
built on (shim/criu/pageserver.py). Root; run under ``flock /run/ks-e2e.lock``."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.chunks import Chunk, PagesFile
from kubectl_snapshot.core.reference import Reference
from shim.criu.images import _load, _pycriu_images
from shim.criu.lazyimages import ImagePageSource
from shim.criu.pageproto import PAGE_SIZE, PE_LAZY, PE_PRESENT
from shim.engine.lazysource import ChunkPageSource, from_registry
from tests.support import lazyrestore as lr
from tests.support.registry import RegistryServer, registry_server

SIZE = 128 << 20


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[lr.Box, Path]]:
    with lr.dumped(tmp_path_factory.mktemp("lazy"), f"ks-lazy-{os.getpid()}", SIZE, check_sum=True) as d:
        yield d


@pytest.fixture
def box(dumped: tuple[lr.Box, Path]) -> Iterator[lr.Box]:
    with lr.fresh(dumped[0]) as b:
        yield b


def _present_pages(images: Path, name: str) -> int:
    entries = _load(_pycriu_images(), str(images / name))
    return sum(e["nr_pages"] for e in entries[1:] if e.get("flags", PE_PRESENT) & PE_PRESENT)


def test_the_lazy_images_keep_only_what_the_restore_writes(dumped: tuple[lr.Box, Path], tmp_path: Path) -> None:
    _, images = dumped
    prepared = lr.prepare(images, tmp_path / "lazy")
    assert len(prepared.tasks) == 1
    (task,) = prepared.tasks.values()
    pages = f"pages-{task.pages_id}.img"
    original = _present_pages(images, f"pagemap-{task.pid}.img")
    assert task.layout.kept_pages + task.layout.lazy_pages == original
    assert prepared.lazy_bytes >= SIZE  # the pattern is private anonymous memory: all of it is lazy
    assert (tmp_path / "lazy" / pages).stat().st_size == prepared.kept_bytes < (images / pages).stat().st_size // 4
    lazy_flags = [e["flags"] for e in _load(_pycriu_images(), str(tmp_path / "lazy" / f"pagemap-{task.pid}.img"))[1:]]
    assert set(lazy_flags) == {PE_LAZY, PE_PRESENT}
    # each thread's stack-pointer page stays with the restore (CRIU's is_stack), the rest of its stack is lazy
    (entry,) = _load(_pycriu_images(), str(images / "pstree.img"))
    assert len(entry["threads"]) == 2
    for tid in entry["threads"]:
        sp = _load(_pycriu_images(), str(images / f"core-{tid}.img"))[0]["thread_info"]["gpregs"]["sp"]
        page = sp & ~(PAGE_SIZE - 1)
        assert any(r.vaddr <= page < r.end for r in task.layout.kept), hex(sp)
        assert not any(r.vaddr <= page < r.end for r in task.layout.lazy), hex(sp)
        assert any(r.vaddr <= page - PAGE_SIZE < r.end for r in task.layout.lazy) or any(
            r.vaddr <= page + PAGE_SIZE < r.end for r in task.layout.lazy
        ), hex(sp)
    # what is kept is the original's bytes, in order; what is lazy, the source reads from the original
    with open(images / pages, "rb") as orig, open(tmp_path / "lazy" / pages, "rb") as kept:
        for r in task.layout.kept:
            orig.seek(r.offset)
            assert kept.read(r.nr_pages * PAGE_SIZE) == orig.read(r.nr_pages * PAGE_SIZE)
        src = ImagePageSource(str(images), prepared.tasks)
        try:
            r = task.layout.lazy[len(task.layout.lazy) // 2]
            orig.seek(r.offset)
            assert src.pages(task.pid, r.vaddr, r.nr_pages) == orig.read(r.nr_pages * PAGE_SIZE)
        finally:
            src.close()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_lazy_restore_runs_first_and_gets_every_page_from_the_page_server(
    dumped: tuple[lr.Box, Path], box: lr.Box, tmp_path: Path, transport: str
) -> None:
    """Over a socketpair (the daemon's --ps-socket: what the agent should use) and over TCP on loopback."""
    _, images = dumped
    prepared = lr.prepare(images, tmp_path / "lazy")
    lazy = lr.restore_lazy(box, images, prepared, tmp_path / "work", transport=transport)
    try:
        # the process runs before its memory is back: it checks its pattern through page faults
        assert box.verify() == lr.expected_sum(SIZE, box.seed), lazy.daemon_log()
        lazy.wait_resident()
        assert lazy.daemon.returncode == 0, lazy.daemon_log()
        stats = lazy.server.wait(10)
        assert stats.error is None and stats.closed_at is not None, stats
        total = prepared.lazy_bytes // PAGE_SIZE
        assert SIZE // PAGE_SIZE <= stats.pages <= total, (stats.pages, total)  # each page once at most
        # every page is resident: the pattern again, byte for byte (its SHA-256), and the process goes on
        assert box.verify() == lr.expected_sum(SIZE, box.seed)
        n = box.counter()
        box.wait_for(lambda: box.counter() > n + 5, 10, "the counter to go on")
        assert "UFFD transferred pages" in lazy.daemon_log()
    finally:
        lazy.close()


def test_a_pod_with_more_than_2_gib_in_one_mapping_is_restored_lazily(tmp_path: Path) -> None:
    """One 2.1 GiB bytearray: a single anonymous mapping, whose one lazy pagemap entry made CRIU's daemon
    exit before its first page (an int in criu/uffd.c); the layout cuts lazy entries short of that."""
    size = (2 << 30) + (64 << 20)
    with lr.dumped(tmp_path / "big", f"ks-lazy-big-{os.getpid()}", size) as (box, images), lr.fresh(box):
        prepared = lr.prepare(images, tmp_path / "lazy")
        lazy = lr.restore_lazy(box, images, prepared, tmp_path / "work")
        try:
            lazy.wait_resident()
            assert lazy.daemon.returncode == 0, lazy.daemon_log()
            assert box.verify() == lr.expected_sum(size, box.seed)
        finally:
            lazy.close()


def test_a_page_that_cannot_be_fetched_kills_the_process(
    dumped: tuple[lr.Box, Path], box: lr.Box, tmp_path: Path
) -> None:
    _, images = dumped
    prepared = lr.prepare(images, tmp_path / "lazy")
    inner = ImagePageSource(str(images), prepared.tasks)
    source = lr.StallingSource(inner, after_pages=(SIZE // PAGE_SIZE) // 4)
    reasons: list[str] = []

    def kill(reason: str) -> None:
        reasons.append(reason)
        box.kill()

    lazy = lr.restore_lazy(box, images, prepared, tmp_path / "work", source=source, on_failure=kill, retries=2)
    try:
        pid = box.pid()
        source.release.set()  # from here the source fails
        (box.data / "verify").write_text("")
        box.wait_for(lambda: not os.path.exists(f"/proc/{pid}") or lr.zombie(pid), 60, "the process to be killed")
        assert not (box.data / "sum").exists()  # it never finished reading its memory
        lazy.wait_resident(60)
        stats = lazy.server.wait(10)
        assert len(reasons) == 1 and "could not be fetched after 3 tries" in reasons[0] and "503" in reasons[0]
        assert stats.failed_range is not None and stats.retries == 2
    finally:
        lazy.close()
        inner.close()


def test_a_page_server_that_stops_answering_blocks_the_process_until_its_timeout_kills_it(
    dumped: tuple[lr.Box, Path], box: lr.Box, tmp_path: Path
) -> None:
    """CRIU's lazy-pages daemon waits for ever (no timeout): the faulting thread stays blocked. The page
    server's own deadline per request is what ends it."""
    _, images = dumped
    prepared = lr.prepare(images, tmp_path / "lazy")
    inner = ImagePageSource(str(images), prepared.tasks)
    source = lr.StallingSource(inner, after_pages=(SIZE // PAGE_SIZE) // 4)
    killed_at: list[float] = []

    def kill(reason: str) -> None:
        killed_at.append(time.monotonic())
        box.kill()

    lazy = lr.restore_lazy(
        box, images, prepared, tmp_path / "work", source=source, on_failure=kill, request_timeout_s=6, retries=0
    )
    try:
        pid = box.pid()
        (box.data / "verify").write_text("")
        box.wait_for(lambda: source.stalled_at is not None, 60, "the source to stall")
        time.sleep(1)
        n = box.counter()
        time.sleep(2)
        # blocked in a page fault: alive, its loop stopped, the daemon still waiting
        assert os.path.exists(f"/proc/{pid}") and not lr.zombie(pid) and box.counter() == n
        assert lazy.daemon.poll() is None and not killed_at
        box.wait_for(lambda: not os.path.exists(f"/proc/{pid}") or lr.zombie(pid), 30, "the process to be killed")
        assert source.stalled_at is not None and killed_at and 5 < killed_at[0] - source.stalled_at < 15
        lazy.wait_resident(60)
    finally:
        source.release.set()
        lazy.close()
        inner.close()


def test_criu_zero_fills_what_a_page_server_that_hangs_up_never_sent(
    dumped: tuple[lr.Box, Path], box: lr.Box, tmp_path: Path
) -> None:
    """Recorded CRIU/kernel behaviour, why the page server reports a failure before it closes: without a
    kill, the daemon exits, the userfaultfd closes, and the kernel maps a zero page wherever a page had not
    come yet. The process is not stopped: it runs on with that memory (a Python process then soon dies of
    a NULL pointer read from a zeroed page; one whose zeroed pages are data computes on wrong data).
    The process is held with SIGSTOP until the daemon has gone so the memory can be read as it is then."""
    _, images = dumped
    prepared = lr.prepare(images, tmp_path / "lazy")
    inner = ImagePageSource(str(images), prepared.tasks)
    source = lr.StallingSource(inner, after_pages=(SIZE // PAGE_SIZE) // 4)
    lazy = lr.restore_lazy(
        box, images, prepared, tmp_path / "work", source=source, on_failure=None, retries=0, record=True
    )
    try:
        pid = box.pid()
        os.kill(pid, signal.SIGSTOP)  # no fault of its own from here
        source.release.set()  # the source fails, the page server hangs up
        lazy.wait_resident(60)
        assert lazy.daemon.returncode != 0
        assert "Remote side closed connection" in lazy.daemon_log()
        (task,) = prepared.tasks.values()
        served = {v + i * PAGE_SIZE for _, v, n in lazy.server.stats.served for i in range(n)}
        missing = [
            (r.vaddr + i * PAGE_SIZE, r.offset + i * PAGE_SIZE)
            for r in task.layout.lazy
            for i in range(r.nr_pages)
            if r.vaddr + i * PAGE_SIZE not in served
        ]
        assert len(missing) > (SIZE // PAGE_SIZE) // 2
        sample = missing[:: len(missing) // 64][:64]
        zero = bytes(PAGE_SIZE)
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem, open(images / f"pages-{task.pages_id}.img", "rb") as f:
            for vaddr, offset in sample:
                f.seek(offset)
                assert f.read(PAGE_SIZE) != zero  # random pattern in the dump ...
                mem.seek(vaddr)
                assert mem.read(PAGE_SIZE) == zero, hex(vaddr)  # ... zeros in the process
        n, ticks = box.counter(), lr.cpu_ticks(pid)
        os.kill(pid, signal.SIGCONT)
        # not killed by CRIU: it runs on (until, perhaps, it crashes on a zeroed pointer), counting, or
        # running on the CPU on what its zeroed pages now say (seen once in CI: alive 10 s later, its
        # counter still)
        box.wait_for(
            lambda: box.counter() > n or lr.zombie(pid) or lr.cpu_ticks(pid) > ticks + 10,
            10,
            "the process to go on (count, or run on the CPU) or crash",
        )
        if not lr.zombie(pid):
            try:
                got: str | None = box.verify(timeout=10)
            except AssertionError:  # it crashed meanwhile
                got = None
            assert got != lr.expected_sum(SIZE, box.seed)
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
        lazy.close()
        inner.close()


@pytest.fixture(scope="module")
def dumped_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[lr.Box, Path]]:
    with lr.dumped(tmp_path_factory.mktemp("lazy-tree"), f"ks-lazy-tree-{os.getpid()}", 64 << 20, child=True) as d:
        yield d


def test_a_process_tree_is_restored_lazily(dumped_tree: tuple[lr.Box, Path], tmp_path: Path) -> None:
    """A parent and its child sharing most of the pattern copy-on-write (the child rewrote a quarter):
    the daemon asks for each task's pages by its pid; both come back whole."""
    box, images = dumped_tree
    prepared = lr.prepare(images, tmp_path / "lazy")
    assert len(prepared.tasks) == 2
    lazy = lr.restore_lazy(box, images, prepared, tmp_path / "work", record=True)
    try:
        want, want_child = lr.expected_sum(box.size, box.seed), lr.expected_child_sum(box.size, box.seed)
        assert box.verify() == want, lazy.daemon_log()
        assert box.verify(prefix="c") == want_child, lazy.daemon_log()
        lazy.wait_resident()
        assert lazy.daemon.returncode == 0, lazy.daemon_log()
        stats = lazy.server.wait(10)
        assert stats.error is None and stats.closed_at is not None
        assert {dst for dst, _, _ in stats.served} == set(prepared.tasks)
        assert box.verify() == want and box.verify(prefix="c") == want_child
    finally:
        lazy.close()
        box.kill()
        box.remove()


def test_a_lazy_restore_gets_its_pages_from_the_registrys_chunks(
    dumped: tuple[lr.Box, Path], box: lr.Box, tmp_path: Path, registry: RegistryServer
) -> None:
    """The page source a lazy restore from a snapshot uses (shim/engine/lazysource.py): the dump's pages
    image cut into zstd chunks pushed to a real registry, each fetched whole (verified) on the first
    request that falls in it; the pattern comes back byte for byte and each chunk was downloaded once."""
    _, images = dumped
    prepared = lr.prepare(images, tmp_path / "lazy")
    (task,) = prepared.tasks.values()
    name = f"pages-{task.pages_id}.img"
    ref = Reference.parse(f"{registry.host}/lazy/chunks-{os.getpid()}@sha256:" + "0" * 64)
    pf = lr.push_chunks(RegistryClient(plain_http=True), ref, images / name)
    chunks = pf.chunks
    fetched: list[str] = []

    class Counting(RegistryClient):
        def fetch_blob(self, ref: Reference, digest: str, out: Any, **kw: Any) -> int:
            fetched.append(digest)
            return super().fetch_blob(ref, digest, out, **kw)

    source = ChunkPageSource(prepared.tasks, {name: pf}, from_registry(Counting(plain_http=True), ref))
    lazy = lr.restore_lazy(box, images, prepared, tmp_path / "work", source=source)
    try:
        assert box.verify() == lr.expected_sum(SIZE, box.seed), lazy.daemon_log()
        lazy.wait_resident()
        stats = lazy.server.wait(10)
        assert stats.error is None and stats.closed_at is not None, stats
        assert box.verify() == lr.expected_sum(SIZE, box.seed)
        lazy_chunks = {c.digest for c in chunks if any(
            r.offset < c.offset + c.length and c.offset < r.offset + r.nr_pages * PAGE_SIZE for r in task.layout.lazy
        )}  # fmt: skip
        assert sorted(fetched) == sorted(lazy_chunks)  # each chunk holding lazy pages, once (the cache holds all)
    finally:
        lazy.close()
