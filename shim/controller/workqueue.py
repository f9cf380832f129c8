"""Work the agent has accepted but not started yet, done one item at a time in a thread of its own.

The watch that claims PodSnapshots hands each claimed one here and goes on watching, so that claims
(and refusals) are never held up by a long snapshot, while the snapshots of one node still run one
after the other (their freezes never overlap). ``length`` is what the queue-length metric shows.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)
Job = Callable[[], None]


class WorkQueue:
    def __init__(self, name: str, *, on_length: Callable[[int], None] | None = None, inline: bool = False) -> None:
        self.name = name
        self._on_length = on_length or (lambda _n: None)
        self._inline = inline
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def inline(cls) -> WorkQueue:
        """Runs each job at once in the caller's thread (standalone use and unit tests)."""
        return cls("inline", inline=True)

    @property
    def length(self) -> int:
        with self._lock:
            return self._waiting

    def submit(self, job: Job) -> None:
        if self._inline:
            self._run(job)
            return
        self._change(+1)
        self._jobs.put(job)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
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
