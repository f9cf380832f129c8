"""The pages each restored container's processes asked for first, kept on this node until its next save.

A restore remembers the snapshot's own list for each container (`read_staged`: the layer's
``kubectl-snapshot.hotpages.json``, extracted with the layer, verified and, when sealed, opened; carried
forward through an eager restore); a lazy restore that got every page in replaces it with what its
processes faulted on first (LazySession.trace). The container's next save writes them into its layer
(shim/engine/checkpoint.py), so the lazy restore after it fetches those pages first (core/hotpages.py).
Keyed by pod uid and container name: a pod's save only ever holds its own containers' faults. In memory
only: an agent restart forgets them, and the next save then goes without (the restore after it reads in
file order).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import OrderedDict

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import hotpages
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


def read_staged(staged_dir: str) -> tuple[HotRange, ...]:
    """The list a staged container's layer held (its file at the staged dir's root); () where there is
    none, it is not a plain file (never followed through a link) or it does not parse."""
    with contextlib.suppress(OSError):
        fd = os.open(os.path.join(staged_dir, C.HOT_PAGES_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return hotpages.from_bytes(os.read(fd, hotpages.MAX_FILE_BYTES + 1))
        finally:
            os.close(fd)
    return ()
