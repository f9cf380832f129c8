"""Fair scheduling of the agent's work across namespaces (issue 10, item 5).

Snapshots and restores used to run one after another in the watch thread that saw them, so one
namespace could queue work that starved every other, and one restore stuck on a slow registry held up
all the next. Work is now queued per key (the namespace) and run by a few worker threads that take
the keys in turn (round robin), with at most `per_key` jobs of one key at a time: a namespace that
queues a hundred jobs gets one turn in N like any other, and a slow job occupies one worker only.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
Job = Callable[[], object]  # what a job returns is ignored


class FairScheduler:
    def __init__(self, *, workers: int, per_key: int, name: str = "work") -> None:
        if workers < 1 or per_key < 1:
            raise ValueError("workers and per_key must be at least 1")
        self.per_key = per_key
        self._queues: dict[str, collections.deque[Job]] = {}
        self._order: collections.deque[str] = collections.deque()  # keys with queued jobs, next turn first
        self._running: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, key: str, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("scheduler is closed")
            q = self._queues.setdefault(key, collections.deque())
            q.append(job)
            if key not in self._order:
                self._order.append(key)
            self._cond.notify()

    def pending(self) -> dict[str, int]:
        with self._cond:
            return {k: len(q) for k, q in self._queues.items() if q}

    def close(self, *, wait: bool = True) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                t.join()

    def _next(self) -> tuple[str, Job] | None:
        """The next job of the first key in turn that is under its limit (caller holds the lock)."""
        for _ in range(len(self._order)):
            key = self._order[0]
            self._order.rotate(-1)  # whatever happens, this key's next turn is after the others
            if self._running[key] >= self.per_key:
                continue
            q = self._queues[key]
            job = q.popleft()
            if not q:
                self._order.remove(key)
                del self._queues[key]
            self._running[key] += 1
            return key, job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                picked = self._next()
                while picked is None:
                    if self._closed:
                        return
                    self._cond.wait()
                    picked = self._next()
            key, job = picked
            try:
                job()
            except Exception:
                log.exception("job of %s failed", key)
            finally:
                with self._cond:
                    self._running[key] -= 1
                    if not self._running[key]:
                        del self._running[key]
                    self._cond.notify_all()
