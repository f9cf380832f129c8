"""A lazy restore on this node: the pod runs before its memory is back (docs/lazy-restore.md).

Staging (`stage_lazy`) leaves the pages of the tasks' private memory in the registry: once the container's
layer is extracted, each task's pagemap is rewritten with its lazy ranges flagged and its pages file
holds only what CRIU writes itself (stacks, file-backed and shared mappings), read from the chunks that
hold them; page files no task's memory names (shared memory) are staged whole. What is left is served
while the pod runs (`LazySession`): a page server over a socketpair answers CRIU's lazy-pages daemon,
which listens in the container's staged dir (the restore's work dir, where the runtime wrapper sees its
socket and adds ``--lazy-pages``), from a bounded cache of verified, opened chunks.

The failure case is explicit: a page that cannot be fetched (after the page server's retries and
deadline), or a daemon that dies with pages missing, ends the container through `on_failure` before
the daemon's connection goes: the kernel would zero-fill what had not come and the process would run on
with wrong memory. A session that no restore ever connected to (the restore failed or was refused) is
ended after CONNECT_TIMEOUT_S. At most LAZY_SLOTS sessions run on a node; a restore beyond them is eager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import hotpages
from kubectl_snapshot.core.errors import CriuFailed, FailedPrecondition
from kubectl_snapshot.core.hotpages import HotRange
from kubectl_snapshot.core.model import ContainerRecord
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import Opener
from shim.criu.lazydaemon import LazyPagesDaemon
from shim.criu.lazyimages import TaskLayout, read_lazy_layouts, rewrite_for_lazy
from shim.criu.pageproto import PAGE_SIZE
from shim.criu.pageserver import PageServer, ServeStats
from shim.engine.hottraces import read_staged
from shim.engine.lazysource import ChunkPageSource, from_registry
from shim.engine.node_ports import Registry
from shim.engine.staging import lazy_used_dir
from shim.engine.stream import fetch_chunks

log = logging.getLogger(__name__)

LAZY_SLOTS = 4  # lazy sessions at once on a node (each holds up to SESSION_CACHE_BYTES + SESSION_HOT_BYTES of chunks)
SESSION_CACHE_BYTES = 64 << 20
SESSION_HOT_BYTES = 128 << 20  # the chunks of the layer's hot pages fetched first (held until the fill reaches them)
READAHEAD_CHUNKS = 3  # chunks downloaded ahead of the one served (as many as the cache holds beside it)
CONNECT_TIMEOUT_S = 300.0  # a staged lazy restore that no restore asked a page of within this is ended
_slots = threading.BoundedSemaphore(LAZY_SLOTS)
_in_use = [0]  # slots taken (sessions staged or serving), under _in_use_lock
_in_use_lock = threading.Condition()


def take_slots(n: int) -> bool:
    """Places for `n` lazy sessions on this node (each session gives its own back when it ends); False,
    with none taken, when fewer are free (the restore is eager)."""
    taken = 0
    while taken < n and _slots.acquire(blocking=False):
        taken += 1
    with _in_use_lock:
        _in_use[0] += taken
    if taken < n:
        give_slot(taken)
        return False
    return True


def give_slot(n: int = 1) -> None:
    for _ in range(n):
        with contextlib.suppress(ValueError):
            _slots.release()
            with _in_use_lock:
                _in_use[0] -= 1
                _in_use_lock.notify_all()


def wait_until_idle(timeout_s: float) -> bool:
    """Wait (at most `timeout_s`) until no lazy session runs on this node: an agent asked to stop (a
    DaemonSet's roll) lets the lazy phases it serves finish first, since its successor can only restore
    their containers again, eagerly. True when none runs."""
    with _in_use_lock:
        return _in_use_lock.wait_for(lambda: _in_use[0] <= 0, timeout=timeout_s)


@dataclass
class LazyStage:
    """One container staged for a lazy restore: its staged dir and where the rest of its pages are."""

    container: str
    staged_dir: str
    tasks: dict[int, TaskLayout]
    source: ChunkPageSource
    kept_bytes: int
    hot: tuple[HotRange, ...] = ()  # the layer's record of the pages asked for first (core/hotpages.py)

    @property
    def lazy_bytes(self) -> int:
        return sum(t.layout.lazy_pages for t in self.tasks.values()) * PAGE_SIZE


def stage_lazy(
    record: ContainerRecord,
    staged_dir: str,
    *,
    registry: Registry,
    ref: Reference,
    opener: Opener | None,
    on_bytes: Callable[[int], None] | None = None,
    cache_bytes: int = SESSION_CACHE_BYTES,
) -> LazyStage | None:
    """The container's checkpoint/ (its layer extracted into `staged_dir`, no page file yet) made ready
    for a lazy restore (see the module); None, with nothing changed, when its images cannot be restored
    lazily (the caller stages its pages eagerly)."""
    cp = os.path.join(staged_dir, C.CHECKPOINT_DIRECTORY)
    files = {pf.name: pf for pf in record.pages}
    try:
        tasks = read_lazy_layouts(cp)
        source = ChunkPageSource(tasks, files, from_registry(registry, ref, opener), cache_bytes=cache_bytes,
                                 readahead=READAHEAD_CHUNKS, hot_bytes=SESSION_HOT_BYTES)  # fmt: skip
    except (FailedPrecondition, KeyError) as e:  # a layout CRIU's rule refuses, a pages file not in chunks
        log.warning("container %s is restored eagerly: its images cannot be restored lazily: %s", record.name, e)
        return None
    served = {f"pages-{t.pages_id}.img" for t in tasks.values()}
    others = [pf for pf in record.pages if pf.name not in served]
    if others:
        fetch_chunks(registry, ref, others, cp, on_bytes=on_bytes, opener=opener)
    kept = rewrite_for_lazy(cp, tasks, source.read)
    return LazyStage(record.name, staged_dir, tasks, source, kept, read_staged(staged_dir))


class LazySession:
    """One container's lazy phase: its page server and lazy-pages daemon, supervised until every page is
    in (`on_done`) or the container had to be ended (`on_failure`, once, with the reason)."""

    def __init__(
        self,
        stage: LazyStage,
        *,
        criu: Sequence[str],
        criu_version: str,
        on_failure: Callable[[str], None],
        on_done: Callable[[ServeStats, float], None] | None = None,
        request_timeout_s: float = 30.0,
        retries: int = 3,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.stage = stage
        self._criu = list(criu)
        self._on_failure = on_failure
        self._on_done = on_done
        self._connect_timeout_s = connect_timeout_s
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._keep_staged_dir = False
        self.server, self._theirs = PageServer.over_socketpair(
            stage.source,
            criu_version=criu_version,
            on_failure=self._fail,
            request_timeout_s=request_timeout_s,
            retries=retries,
        )
        self.daemon: LazyPagesDaemon | None = None
        self.thread: threading.Thread | None = None
        self.started = 0.0
        self.warmed = 0  # chunks holding the layer's hot pages, fetched first (or held since staging)

    def start(self) -> LazySession:
        """Serve, start the daemon and return once it listens in the staged dir (raises: nothing left running)."""
        self.started = time.monotonic()
        self.warmed = self.stage.source.warm(self.stage.hot)  # the pages asked for first last time, first
        self.server.start()
        try:
            cp = os.path.join(self.stage.staged_dir, C.CHECKPOINT_DIRECTORY)
            self.daemon = LazyPagesDaemon(self._criu, cp, self.stage.staged_dir, self._theirs)
            self._theirs.close()
            self.daemon.wait_listening()
        except BaseException:
            self._theirs.close()
            self.close()
            raise
        self.thread = threading.Thread(target=self._supervise, name=f"lazy-{self.stage.container}", daemon=True)
        self.thread.start()
        return self

    def end(self, reason: str) -> None:
        """End the container now (`on_failure`, once), as a page that cannot come would: whoever serves it
        is going away."""
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failed.is_set():
                return
            self._failed.set()
        log.error("lazy restore of container %s: %s", self.stage.container, reason)
        try:
            self._on_failure(reason)
        except Exception:
            log.exception("ending container %s after its lazy restore failed", self.stage.container)

    def _supervise(self) -> None:
        daemon = self.daemon
        assert daemon is not None
        try:
            rc = daemon.wait(1.0)
            while rc is None:
                if self.server.stats.pages == 0 and time.monotonic() - self.started > self._connect_timeout_s:
                    log.warning("lazy restore of container %s: no restore asked for a page within %.0f s; "
                                "ended", self.stage.container, self._connect_timeout_s)  # fmt: skip
                    return
                rc = daemon.wait(1.0)
            stats = self.server.wait(30)
            if rc != 0 or stats.error or stats.failed_range is not None:
                why = "; ".join(w for w in (stats.error, f"criu lazy-pages exited {rc}") if w)
                self._fail(
                    f"the lazy restore stopped with pages missing ({why}); {stats.pages} of "
                    f"{self.stage.source.total_pages()} pages had come; lazy-pages.log tail:\n"
                    + daemon.log_tail(5, lazy_used_dir(self.stage.staged_dir))
                )
            elif self._on_done is not None:
                self._on_done(stats, time.monotonic() - self.started)
        except Exception as e:
            self._fail(f"internal error supervising the lazy restore: {e}")
        finally:
            self.close()

    def trace(self) -> tuple[HotRange, ...]:
        """The pages this restore's processes asked for first, then those the snapshot recorded that they
        have not asked for yet: what the container's next save writes into its layer."""
        return hotpages.merge(hotpages.from_faults(self.stage.source.faults()), self.stage.hot)

    def hand_over(self) -> None:
        """The container's staged dir is another's from now (an eager restore of the same save staged
        there after this lazy one failed): close() leaves it, and removes only what the restore used."""
        with self._lock:
            self._keep_staged_dir = True

    def close(self) -> None:
        """Stop serving, end the daemon, remove the staged dir and free the node's slot (idempotent)."""
        if self.daemon is not None:
            self.daemon.kill()
        self.server.stop()
        self.stage.source.close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keep = self._keep_staged_dir
        if not keep:
            shutil.rmtree(self.stage.staged_dir, ignore_errors=True)  # a restore that never ran
        shutil.rmtree(lazy_used_dir(self.stage.staged_dir), ignore_errors=True)
        give_slot()


def session_failure(container: str, registry_host: str, reason: str, *, again: bool = False) -> CriuFailed:
    """The error a pod's Event carries when its lazy restore ended it (`again`: restored eagerly next)."""
    return CriuFailed(
        f"container {container}'s memory could not all be fetched from {registry_host}: {reason}; "
        "the container was stopped (running on would have read zeros where its memory was)"
        + ("; it is restored again, eagerly, from the same save" if again else ""),
        hint="restore it eagerly (without --lazy, or restoreMode: eager) once the registry answers",
    )
