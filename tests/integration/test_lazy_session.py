"""A lazy restore as the agent runs it (shim/engine/lazyrestore.py), with real runc, CRIU and registry:
a container's staged dir without its page file (the chunks in a registry), `stage_lazy` writing the
pagemaps and the pages CRIU keeps, a `LazySession` (page server over a socketpair, ``criu lazy-pages``
listening in the staged dir), then ``runc restore --lazy-pages`` with that dir as its work dir, as the
runtime wrapper runs it. The legitimate case comes back byte for byte and reports every page in; a
registry that dies mid-restore ends the container through on_failure, never a process on zero-filled
memory. Root; run under ``flock /run/ks-e2e.lock``."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import hotpages
from kubectl_snapshot.core.chunks import PagesFile
from kubectl_snapshot.core.hotpages import HotRange
from kubectl_snapshot.core.reference import Reference
from shim.criu.pageserver import ServeStats
from shim.engine import lazyrestore
from shim.engine.lazyrestore import LazySession, LazyStage, stage_lazy
from shim.engine.staging import lazy_used_dir
from tests.support import lazyrestore as lr
from tests.support.registry import RegistryServer

SIZE = 96 << 20


@dataclass
class Record:  # what stage_lazy reads of a snapshot's ContainerRecord
    name: str
    pages: tuple[PagesFile, ...]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[lr.Box, Path]]:
    with lr.dumped(tmp_path_factory.mktemp("lazy-session"), f"ks-lazys-{os.getpid()}", SIZE) as d:
        yield d


@pytest.fixture
def box(dumped: tuple[lr.Box, Path]) -> Iterator[lr.Box]:
    with lr.fresh(dumped[0]) as b:
        yield b


def _staged(images: Path, staged: Path, registry: RegistryServer | str) -> tuple[Record, Reference]:
    """The staged dir as the agent's staging leaves it for a lazy restore: the layer's images, no page file."""
    cp = staged / C.CHECKPOINT_DIRECTORY
    cp.mkdir(parents=True)
    host = registry if isinstance(registry, str) else registry.host
    ref = Reference.parse(f"{host}/lazy/session-{os.getpid()}-{staged.name}@sha256:" + "0" * 64)
    files = []
    for f in sorted(images.iterdir()):
        if f.name.startswith("pages-"):
            files.append(lr.push_chunks(RegistryClient(plain_http=True), ref, f))
        else:
            shutil.copyfile(f, cp / f.name)
    return Record("app", tuple(files)), ref


class Registry(RegistryClient):
    """The registry client staging uses, counting blob downloads."""

    def __init__(self) -> None:
        super().__init__(plain_http=True)
        self.fetched = 0

    def fetch_blob(self, ref: Reference, digest: str, out: Any, **kw: Any) -> int:
        self.fetched += 1
        return super().fetch_blob(ref, digest, out, **kw)


def _restore(box: lr.Box, staged: Path) -> None:
    res = box.restore_cmd(staged / C.CHECKPOINT_DIRECTORY, staged, "--lazy-pages")
    assert res.returncode == 0, f"{res.stdout}\n{lr.log_tail(staged / 'restore.log')}"


def test_a_staged_lazy_restore_runs_first_gets_every_page_and_cleans_up(
    dumped: tuple[lr.Box, Path], box: lr.Box, tmp_path: Path, registry: RegistryServer
) -> None:
    _, images = dumped
    staged = tmp_path / "by-pod" / "app"
    record, ref = _staged(images, staged, registry)
    client = Registry()
    stage = stage_lazy(record, str(staged), registry=client, ref=ref, opener=None)  # type: ignore[arg-type]
    assert stage is not None
    assert stage.lazy_bytes >= SIZE and stage.kept_bytes < SIZE // 8
    # staging fetched only the chunks that hold the kept pages (stacks, ...), not the pattern's
    assert 0 < client.fetched < sum(len(pf.chunks) for pf in record.pages) // 2
    done: list[tuple[ServeStats, float]] = []
    failures: list[str] = []
    assert lazyrestore.take_slots(1)
    session = LazySession(stage, criu=["criu"], criu_version=lr.criu_version(), on_failure=failures.append,
                          on_done=lambda st, s: done.append((st, s)))  # fmt: skip
    session.start()
    try:
        assert (staged / C.LAZY_PAGES_SOCKET).is_socket()
        _restore(box, staged)
        os.rename(staged, lazy_used_dir(str(staged)))  # as the runtime wrapper does once the restore returned
        assert box.verify() == lr.expected_sum(SIZE, box.seed)
        assert session.thread is not None
        session.thread.join(120)
        assert done and not failures, failures
        assert done[0][0].pages * 4096 >= SIZE
        assert box.verify() == lr.expected_sum(SIZE, box.seed)  # all resident: byte for byte again
        n = box.counter()
        box.wait_for(lambda: box.counter() > n + 3, 10, "the counter to go on")
        assert not os.path.exists(lazy_used_dir(str(staged)))  # the session removed what it served from
        assert session.daemon is not None and session.daemon.proc.returncode == 0
    finally:
        session.close()
    # its slot is free again: every slot can be taken, then given back
    assert lazyrestore.take_slots(lazyrestore.LAZY_SLOTS)
    lazyrestore.give_slot(lazyrestore.LAZY_SLOTS)


def test_a_registry_that_dies_mid_restore_ends_the_container_with_the_reason(
    dumped: tuple[lr.Box, Path], box: lr.Box, tmp_path: Path, registry_factory: Any
) -> None:
    _, images = dumped
    reg: RegistryServer = registry_factory()
    staged = tmp_path / "by-pod" / "app"
    record, ref = _staged(images, staged, reg)
    stage = stage_lazy(record, str(staged), registry=Registry(), ref=ref, opener=None)  # type: ignore[arg-type]
    assert stage is not None
    failures: list[str] = []
    killed = threading.Event()

    def end(reason: str) -> None:  # what the agent does: the container's task killed, then the Event
        box.kill()
        killed.set()
        failures.append(reason)

    assert lazyrestore.take_slots(1)
    session = LazySession(stage, criu=["criu"], criu_version=lr.criu_version(), on_failure=end,
                          request_timeout_s=5, retries=1)  # fmt: skip
    session.start()
    try:
        reg.stop()  # before the restore: every lazy page must come from a registry that is gone
        _restore(box, staged)
        pid = box.pid()
        (box.data / "verify").write_text("")
        assert killed.wait(60), "on_failure was never called"
        box.wait_for(lambda: not os.path.exists(f"/proc/{pid}") or lr.zombie(pid), 30, "the process to be killed")
        assert not (box.data / "sum").exists()  # it never computed over memory that had not come
        assert session.thread is not None
        session.thread.join(60)
        assert len(failures) == 1, failures  # once, however many ways it was seen
        assert "could not be fetched" in failures[0], failures[0]
    finally:
        session.close()


def _lazy_round(box0: lr.Box, images: Path, staged: Path, registry: RegistryServer,
                hot: tuple[HotRange, ...]) -> tuple[tuple[HotRange, ...], int, LazyStage]:  # fmt: skip
    """One lazy restore given `hot`: (its session's trace, chunks downloaded after staging and before
    the restore, the stage)."""
    record, ref = _staged(images, staged, registry)
    if hot:  # as the layer held it: extracted beside checkpoint/
        (staged / C.HOT_PAGES_FILE).write_bytes(hotpages.to_bytes(hot))
    client = Registry()
    stage = stage_lazy(record, str(staged), registry=client, ref=ref, opener=None)  # type: ignore[arg-type]
    assert stage is not None and stage.hot == hot
    staging_fetches = client.fetched
    done: list[ServeStats] = []
    assert lazyrestore.take_slots(1)
    session = LazySession(stage, criu=["criu"], criu_version=lr.criu_version(), on_failure=pytest.fail,
                          on_done=lambda st, s: done.append(st))  # fmt: skip
    with lr.fresh(box0) as box:
        session.start()
        try:
            deadline = time.monotonic() + 5  # what is warmed comes before any page is asked for
            while client.fetched == staging_fetches and time.monotonic() < deadline:
                time.sleep(0.05)
            warmed = client.fetched - staging_fetches
            assert session.server.stats.pages == 0
            _restore(box, staged)
            os.rename(staged, lazy_used_dir(str(staged)))
            assert box.verify() == lr.expected_sum(SIZE, box.seed)
            assert session.thread is not None
            session.thread.join(120)
            assert done, "the lazy phase did not complete"
            return session.trace(), warmed, stage
        finally:
            session.close()


def test_the_faults_of_one_lazy_restore_are_fetched_first_by_the_next(
    dumped: tuple[lr.Box, Path], tmp_path: Path, registry: RegistryServer
) -> None:
    """The session records the restored process's faults (LazySession.trace: what the next save's layer
    holds); a restore given them downloads their chunks before the process runs, and comes back byte
    for byte. A list naming nothing of this dump (a stale one) warms nothing and changes nothing else."""
    box0, images = dumped
    first, warmed, stage = _lazy_round(box0, images, tmp_path / "1" / "app", registry, ())
    assert first, "no fault was recorded"
    assert warmed == 0
    lazy = [(pid, r) for pid, t in stage.tasks.items() for r in t.layout.lazy]
    for h in first:  # the process's own faults, inside its lazy memory (a walk may cross adjacent ranges)
        at = h.vaddr
        while at < h.end:
            end = next((r.end for pid, r in lazy if pid == h.pid and r.vaddr <= at < r.end), None)
            assert end is not None, (h, f"{at:#x} is not a lazy page")
            at = end
    # the faults so far fall in the chunk staging read already (the program's own heap, beside its stack);
    # a page amid the pattern stands for a working set of its own
    pid, big = max(lazy, key=lambda pr: pr[1].nr_pages)
    hot = (*first, HotRange(pid, big.vaddr + big.nr_pages // 2 * 4096, 1))
    again, warmed, _ = _lazy_round(box0, images, tmp_path / "2" / "app", registry, hot)
    assert warmed >= 1
    assert again, "the trace of a warmed restore is its faults, then the snapshot's list"
    stale = (HotRange(99999, 0x1000, 4), HotRange(max(stage.tasks), 0x1000, 8))
    _, warmed, _ = _lazy_round(box0, images, tmp_path / "3" / "app", registry, stale)
    assert warmed == 0
