"""The pages each restored container's processes asked for first, kept on this node until its next save.

A restore remembers the snapshot's own ``hotPages`` for each container (carried forward through an eager
restore); a lazy restore that got every page in replaces them with what its processes faulted on first
(LazySession.trace). The container's next save writes them into its record (shim/engine/checkpoint.py), so
the lazy restore after it fetches those pages first (core/hotpages.py). Keyed by pod uid and container
name: a pod's record only ever holds its own containers' faults. In memory only: an agent restart
forgets them, and the next save then goes without (the restore after it reads in file order).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kubectl_snapshot.core.hotpages import HotRange

KEEP = 256  # containers remembered, least recently restored first out (each at most MAX_RANGES ranges)


class HotTraces:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._by: OrderedDict[tuple[str, str], tuple[HotRange, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, pod_uid: str, container: str, ranges: tuple[HotRange, ...]) -> None:
        with self._lock:
            key = (pod_uid, container)
            self._by.pop(key, None)
            if ranges and pod_uid:
                self._by[key] = ranges
                while len(self._by) > self._keep:
                    self._by.popitem(last=False)

    def recall(self, pod_uid: str, container: str) -> tuple[HotRange, ...]:
        with self._lock:
            return self._by.get((pod_uid, container), ())


TRACES = HotTraces()  # the agent's, shared by its restores and its saves
