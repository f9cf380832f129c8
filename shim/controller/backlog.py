"""The per-namespace bound on a node's queued and running snapshots or restores (core/backlog.py),
shared by the watch threads that admit requests and the workers that finish them."""

from __future__ import annotations

import threading

from kubectl_snapshot.core.backlog import Backlog
from kubectl_snapshot.core.errors import TooManyRequests


class NamespaceBacklog:
    def __init__(self, bound: int, what: str, node: str = "") -> None:
        self._backlog = Backlog(bound, what, node)
        self._lock = threading.Lock()

    def admit(self, namespace: str, *, exempt: bool = False) -> TooManyRequests | None:
        with self._lock:
            return self._backlog.admit(namespace, exempt=exempt)

    def done(self, namespace: str) -> None:
        with self._lock:
            self._backlog.done(namespace)

    def count(self, namespace: str) -> int:
        with self._lock:
            return self._backlog.counts.get(namespace, 0)
