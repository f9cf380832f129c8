"""Packing ahead: page chunks compressed while the dump still runs (shim/engine/packahead.py), with
real inotify on real files; the registry is the fake node's (pure bookkeeping)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from kubectl_snapshot.core.chunks import PAGE_SIZE
from kubectl_snapshot.core.reference import Reference
from shim.closewatch import CloseWatch
from shim.engine.chunks import plan_checkpoint
from shim.engine.packahead import PackAhead
from shim.engine.stream import push_chunks
from tests.support.fakenode import FakeRegistry
from tests.unit.test_chunks import write_pagemap

REF = Reference.parse("registry.test/app:v1")
PAGES = 3 * 1024 + 5  # 12 MiB and a bit: several chunks


def page_data(n: int, seed: int = 0) -> bytes:
    # compressible but not trivial, different per page
    return b"".join(hashlib.sha256(f"{seed}-{i}".encode()).digest() * (PAGE_SIZE // 32) for i in range(n))


def write_dump(d: Path, seed: int = 0) -> None:
    """What CRIU leaves for one process: the page file, then its pagemap (each written and closed once)."""
    (d / "pages-1.img").write_bytes(page_data(PAGES, seed))
    write_pagemap(d / "pagemap-4242.img", 1, [{1: 0x7F0000000000, 4: 4, 5: PAGES}])


def wait_for(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_close_watch_reports_files_closed_after_writing_only(tmp_path: Path) -> None:
    (tmp_path / "old").write_bytes(b"x")
    with CloseWatch(str(tmp_path)) as w:
        assert w.wait(0) == []
        (tmp_path / "a.img").write_bytes(b"data")
        (tmp_path / "old").read_bytes()  # opened for reading only: not reported
        got: list[str] = []
        deadline = time.monotonic() + 5
        while "a.img" not in got and time.monotonic() < deadline:
            got += w.wait(0.2)
        assert got == ["a.img"]
        os.mkdir(tmp_path / "sub")
        (tmp_path / "sub" / "deep").write_bytes(b"y")  # below the directory: not watched
        assert w.wait(0.1) == []
    with pytest.raises(OSError):
        CloseWatch(str(tmp_path / "missing"))


def test_chunks_packed_ahead_are_taken_and_give_the_same_snapshot(tmp_path: Path) -> None:
    ahead_dir, plain_dir = tmp_path / "ahead", tmp_path / "plain"
    ahead_dir.mkdir()
    plain_dir.mkdir()
    ahead = PackAhead.start(str(ahead_dir))
    assert ahead is not None
    # the worker gives way to everything else (SCHED_IDLE) while the dump runs
    wait_for(lambda: ahead._tid is not None and os.sched_getscheduler(ahead._tid) == os.SCHED_IDLE)
    write_dump(ahead_dir)
    write_dump(plain_dir)
    n = len(plan_checkpoint(str(ahead_dir))[0].spans)
    assert n > 1
    wait_for(lambda: ahead.chunks == n)
    with pytest.raises(RuntimeError):
        ahead.take("pages-1.img", 0, 1, 0)  # not before stop: the worker may still write
    ahead.stop()
    reg_a, reg_p = FakeRegistry(), FakeRegistry()
    got = push_chunks(reg_a, REF, plan_checkpoint(str(ahead_dir)), ahead=ahead)
    want = push_chunks(reg_p, REF, plan_checkpoint(str(plain_dir)))
    assert ahead.used == n
    assert got == want
    assert reg_a.blobs == reg_p.blobs
    for digest, blob in reg_a.blobs.items():
        assert digest == "sha256:" + hashlib.sha256(blob).hexdigest()


def test_a_page_file_changed_after_it_was_packed_is_compressed_again(tmp_path: Path) -> None:
    ahead = PackAhead.start(str(tmp_path))
    assert ahead is not None
    write_dump(tmp_path)
    wait_for(lambda: ahead.chunks > 0)
    ahead.stop()
    time.sleep(0.02)
    (tmp_path / "pages-1.img").write_bytes(page_data(PAGES, seed=1))  # same size, other content
    reg = FakeRegistry()
    got = push_chunks(reg, REF, plan_checkpoint(str(tmp_path)), ahead=ahead)
    assert ahead.used == 0
    want = push_chunks(FakeRegistry(), REF, plan_checkpoint(str(tmp_path)))
    assert got == want


def test_nothing_is_packed_before_the_pagemap_is_closed_or_beyond_the_budget(tmp_path: Path) -> None:
    ahead = PackAhead.start(str(tmp_path), budget=1)
    assert ahead is not None
    (tmp_path / "pages-1.img").write_bytes(page_data(PAGES))
    time.sleep(0.2)
    assert ahead.chunks == 0  # the page file alone: its pagemap may still be written
    write_pagemap(tmp_path / "pagemap-4242.img", 1, [{1: 0x7F0000000000, 4: 4, 5: PAGES}])
    wait_for(lambda: ahead.chunks == 1)
    time.sleep(0.1)
    assert ahead.chunks == 1  # one chunk is over a budget of 1 byte: the rest is left to packaging
    ahead.stop()
    ahead.stop()  # idempotent
    assert not ahead._thread.is_alive()
