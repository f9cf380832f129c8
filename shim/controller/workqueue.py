"""Work the agent has accepted but not started yet, done one item at a time in a thread of its own.

The watch that claims PodSnapshots hands each claimed one here and goes on watching, so that claims
(and refusals) are never held up by a long snapshot, while the snapshots of one node still run one
after the other (their freezes never overlap). ``length`` is what the queue-length metric shows.

Jobs submitted with a ``key`` (the namespace) are taken in turn across keys, first in first out within
one key (issue 10): a namespace that queues a hundred snapshots delays another's by one job, not by a
hundred.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
Job = Callable[[], object]  # what a job returns is ignored


class WorkQueue:
    def __init__(self, name: str, *, on_length: Callable[[int], None] | None = None, inline: bool = False) -> None:
        self.name = name
        self._on_length = on_length or (lambda _n: None)
        self._inline = inline
        self._jobs: dict[str, collections.deque[Job]] = {}
        self._turns: collections.deque[str] = collections.deque()  # keys with jobs, next turn first
        self._waiting = 0
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    @classmethod
    def inline(cls) -> WorkQueue:
        """Runs each job at once in the caller's thread (standalone use and unit tests)."""
        return cls("inline", inline=True)

    @property
    def length(self) -> int:
        with self._lock:
            return self._waiting

    def submit(self, job: Job, *, key: str = "") -> None:
        if self._inline:
            self._run(job)
            return
        self._change(+1)
        with self._lock:
            if key not in self._jobs:
                self._jobs[key] = collections.deque()
                self._turns.append(key)
            self._jobs[key].append(job)
            self._ready.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()

    def _take(self) -> Job:
        with self._lock:
            while not self._turns:
                self._ready.wait()
            key = self._turns.popleft()
            jobs = self._jobs[key]
            job = jobs.popleft()
            if jobs:
                self._turns.append(key)  # its next job waits for every other key's turn
            else:
                del self._jobs[key]
            return job

    def _work(self) -> None:
        while True:
            job = self._take()
            self._change(-1)
            self._run(job)

    def _run(self, job: Job) -> None:
        try:
            job()
        except Exception:  # a job reports its own failures; a bug must not stop the queue
            log.exception("%s: a job failed", self.name)

    def _change(self, delta: int) -> None:
        with self._lock:
            self._waiting += delta
            n = self._waiting
        self._on_length(n)
