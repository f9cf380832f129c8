"""Following one object through the API server until it settles: the loop `snapshot` (a PodSnapshot
until Succeeded or Failed) and `restore` (the restored Pod until it runs or fails) share.

A watch is opened for a window of at most WATCH_WINDOW_S seconds and opened again after it, so the
deadlines are checked at least that often even when the object does not change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kubectl_snapshot.app.ports import Obj

WATCH_WINDOW_S = 10

Watch = Callable[[int], Iterable[tuple[str, Obj]]]  # the events of one window of N seconds


def follow(
    watch: Watch,
    *,
    settle: Callable[[Obj | None, float], Obj | None],
    stop: Callable[[Obj, float], bool],
    deleted: Callable[[], Exception],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    read: Callable[[], Obj] | None = None,
) -> Obj:
    """Watch window after window until `settle` returns the object.

    settle(last, elapsed): before each window, with the newest object seen (None before any): the
    object to return once it settled, None to watch on; it raises when the object failed or the wait
    ran out. stop(obj, elapsed): after each event, whether to end the window early (settle decides
    next). deleted(): the error when the object is deleted meanwhile. read(): where given, a first
    window that saw no event reads the object once (a watch reports nothing of an object that does
    not change).
    """
    start = clock()
    last: Obj | None = None
    while True:
        elapsed = clock() - start
        done = settle(last, elapsed)
        if done is not None:
            return done
        window = int(max(1, min(WATCH_WINDOW_S, timeout_s - elapsed + 1)))
        seen = False
        for etype, obj in watch(window):
            seen = True
            if etype == "DELETED":
                raise deleted()
            last = obj
            if stop(obj, clock() - start):
                break
        if not seen and last is None and read is not None:
            last = read()
