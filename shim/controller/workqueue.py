"""Work the agent has accepted but not started yet, done by a few worker threads of its own.

The watch that claims PodSnapshots hands each claimed one here and goes on watching, so that claims
(and refusals) are never held up by a long snapshot. Several saves of the node run at once (issue
43: a node evacuated within its preemption notice cannot save its pods one after another); which
waiting save starts next is core/saveorder.py's decision: final saves first, earliest deadline, least
to send, namespaces in turn (issue 10), one save per pod at a time, a worker kept for final saves. How
many freezes and dumps overlap is the dump gate's business (shim/controller/dumpgate.py), not the
queue's. ``length`` (jobs waiting) is what the queue-length metric shows.

A job submitted without a ``SaveRequest`` is one of no pod, taken first in first out among its kind.
A waiting job the queue drops (superseded by a newer save of its pod, or too late for its deadline)
never runs: its ``on_drop`` gets the reason instead, outside the queue's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kubectl_snapshot.core import saveorder as O

log = logging.getLogger(__name__)
Job = Callable[[], object]  # what a job returns is ignored
DropFn = Callable[[str], None]  # why the job will never run
IDLE_CHECK_S = 0.5  # how often waiting saves with a deadline are looked at while no worker frees up


@dataclass
class _Entry:
    req: O.SaveRequest
    job: Job
    on_drop: DropFn | None
    since: float


class WorkQueue:
    def __init__(
        self,
        name: str,
        *,
        on_length: Callable[[int], None] | None = None,
        inline: bool = False,
        workers: int = 1,
        reserve: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if workers < 1:
            raise ValueError("a work queue needs at least one worker")
        self.name = name
        self.workers = workers
        self.reserve = O.urgent_reserve(workers) if reserve is None else reserve
        self.clock = clock
        self._on_length = on_length or (lambda _n: None)
        self._inline = inline
        self._waiting: list[_Entry] = []
        self._running: list[O.SaveRequest] = []
        self._turns: dict[str, int] = {}  # jobs started per key since the queue was last idle
        self._seq = 0
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []

    @classmethod
    def inline(cls) -> WorkQueue:
        """Runs each job at once in the caller's thread (standalone use and unit tests)."""
        return cls("inline", inline=True)

    @property
    def length(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def submit(
        self, job: Job, *, key: str = "", order: O.SaveRequest | None = None, on_drop: DropFn | None = None
    ) -> None:
        if self._inline:
            self._run(job)
            return
        dropped: list[_Entry] = []
        with self._lock:
            self._seq += 1
            req = replace(order or O.SaveRequest(pod=""), key=key, seq=self._seq)
            gone = {w.seq for w in O.superseded((e.req for e in self._waiting), req)}
            dropped = [e for e in self._waiting if e.req.seq in gone]
            self._waiting = [e for e in self._waiting if e.req.seq not in gone]
            self._waiting.append(_Entry(req, job, on_drop, self.clock()))
            n = len(self._waiting)
            self._ready.notify_all()
            while len(self._threads) < self.workers:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        self._on_length(n)
        for e in dropped:
            self._drop(e, "superseded by a newer save of its pod that was queued behind it")

    def _take(self) -> _Entry:
        while True:
            late: list[_Entry] = []
            with self._lock:
                now = self.clock()
                late = [e for e in self._waiting if O.too_late(e.req, now)]
                if late:
                    gone = {e.req.seq for e in late}
                    self._waiting = [e for e in self._waiting if e.req.seq not in gone]
                    n = len(self._waiting)
                chosen = None if late else self._choose()
                if chosen is None and not late:
                    deadlines = any(e.req.deadline is not None for e in self._waiting)
                    self._ready.wait(IDLE_CHECK_S if deadlines else None)
                    continue
            if late:
                self._on_length(n)
                for e in late:
                    left = (e.req.deadline or now) - now
                    self._drop(e, O.too_late_reason(now - e.since, left))
                continue
            assert chosen is not None
            return chosen

    def _choose(self) -> _Entry | None:
        """The next entry to run, taken off the waiting list and counted as running (caller holds the lock)."""
        req = O.pick((e.req for e in self._waiting), self._running, workers=self.workers, reserve=self.reserve,
                     turns=self._turns)  # fmt: skip
        if req is None:
            return None
        entry = next(e for e in self._waiting if e.req.seq == req.seq)
        self._waiting.remove(entry)
        self._running.append(req)
        self._turns[req.key] = self._turns.get(req.key, 0) + 1
        return entry

    def _work(self) -> None:
        while True:
            entry = self._take()
            self._on_length(self.length)
            try:
                self._run(entry.job)
            finally:
                with self._lock:
                    self._running.remove(entry.req)
                    if not self._running and not self._waiting:
                        self._turns.clear()
                    self._ready.notify_all()

    def _run(self, job: Job) -> None:
        try:
            job()
        except Exception:  # a job reports its own failures; a bug must not stop the queue
            log.exception("%s: a job failed", self.name)

    def _drop(self, entry: _Entry, why: str) -> None:
        if entry.on_drop is None:
            log.warning("%s: a job was dropped: %s", self.name, why)
            return
        try:
            entry.on_drop(why)
        except Exception:
            log.exception("%s: reporting a dropped job failed", self.name)
