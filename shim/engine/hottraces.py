"""The pages each restored container's processes asked for first, kept on this node until its next save.

A restore remembers the snapshot's own list for each container (`read_staged`: the layer's
``kubectl-snapshot.hotpages.json``, extracted with the layer, verified and, when sealed, opened; carried
forward through an eager restore); a lazy restore that got every page in replaces it with what its
processes faulted on first (LazySession.trace). The container's next save writes them into its layer
(shim/engine/checkpoint.py), so the lazy restore after it fetches those pages first (core/hotpages.py).
Keyed by pod uid and container name: a pod's save only ever holds its own containers' faults. The agent
also keeps them on disk (`keep_in`: in the restored pod's own state dir, ``staged/by-pod/<uid>/``, 0600,
gone with it when the pod is), so that an agent restarted (upgraded, say) between a restore and the pod's
next save still has them; without that file the next save goes without, and the restore after it reads
in file order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import hotpages
from kubectl_snapshot.core.errors import SnapshotError
from kubectl_snapshot.core.hotpages import HotRange
from shim.host import private

log = logging.getLogger(__name__)

KEEP = 256  # containers remembered, least recently restored first out (each at most MAX_RANGES ranges)


class HotTraces:
    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._by: OrderedDict[tuple[str, str], tuple[HotRange, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._file_of: Callable[[str, str], str] | None = None

    def keep_in(self, file_of: Callable[[str, str], str] | None) -> None:
        """Also keep each list in the file `file_of(pod_uid, container)` (StatePaths.hot_trace), written
        only where its directory (the restored pod's state dir) exists; None: in memory only."""
        self._file_of = file_of

    def remember(self, pod_uid: str, container: str, ranges: tuple[HotRange, ...]) -> None:
        with self._lock:
            key = (pod_uid, container)
            self._by.pop(key, None)
            if ranges and pod_uid:
                self._by[key] = ranges
                while len(self._by) > self._keep:
                    self._by.popitem(last=False)
        if pod_uid and self._file_of is not None:
            self._store(pod_uid, container, ranges)

    def recall(self, pod_uid: str, container: str) -> tuple[HotRange, ...]:
        with self._lock:
            got = self._by.get((pod_uid, container))
        if got is None and pod_uid and self._file_of is not None:
            path = self._path(pod_uid, container)
            got = _read_list(path) if path else ()
            if got:
                with self._lock:
                    self._by.setdefault((pod_uid, container), got)
        return got or ()

    def _path(self, pod_uid: str, container: str) -> str | None:
        assert self._file_of is not None
        try:
            return self._file_of(pod_uid, container)
        except SnapshotError:  # not a name a state dir's path is made of: memory only
            return None

    def _store(self, pod_uid: str, container: str, ranges: tuple[HotRange, ...]) -> None:
        """Write (or, for none, remove) the file; a failure costs the list after a restart, nothing else."""
        path = self._path(pod_uid, container)
        if path is None:
            return
        try:
            if not ranges:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return
            tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"  # a restore and a lazy phase may both write
            with private.create_binary(tmp) as f:
                f.write(hotpages.to_bytes(ranges))
            os.replace(tmp, path)
        except FileNotFoundError:
            pass  # no state dir for this pod (not restored by this agent, or gone): memory only
        except OSError as e:
            log.warning("could not keep the hot pages of %s/%s on disk: %s", pod_uid, container, e)


TRACES = HotTraces()  # the agent's, shared by its restores and its saves


def read_staged(staged_dir: str) -> tuple[HotRange, ...]:
    """The list a staged container's layer held (its file at the staged dir's root); () where there is
    none, it is not a plain file (never followed through a link) or it does not parse."""
    return _read_list(os.path.join(staged_dir, C.HOT_PAGES_FILE))


def _read_list(path: str) -> tuple[HotRange, ...]:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return hotpages.from_bytes(os.read(fd, hotpages.MAX_FILE_BYTES + 1))
        finally:
            os.close(fd)
    return ()
