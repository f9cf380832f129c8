"""Work directories removed after the answer, not before it.

A snapshot's work directory holds its dump: tens of MiB to GiB in the node's tmpfs or its state dir.
Freeing it is the file system's work, which grows with the dump (a 64 MiB object heap's dump: 13.6 ms in
/dev/shm, 1.4 ms on install-node's tmpfs, 6.6 ms on disk; bench/dump_targets.py) and need not delay the
answer to the command or the PodSnapshot's status. `remove_later` renames the directory to a dot name
beside it at once (atomic: no work directory has a leading dot, and what finds leftovers,
checkpoint.recover_interrupted, removes dot names too) and removes it on a thread; `then` runs after
(the memory work area's reservation is released only once its space is free again, shim/host/memwork.py).

The threads are not daemons: a process (a standalone command) waits for them before it exits, so
nothing is left behind by a process that ends normally; one that is killed leaves the dot directory
to the agent's next start, as it would have left the work directory itself.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable

PREFIX = ".removing-"

_lock = threading.Lock()
_running: set[threading.Thread] = set()


def remove_later(path: str, then: Callable[[], None] | None = None) -> None:
    """Take `path` away now and delete it on a thread; `then` (never raising) runs once it is gone."""
    trash = os.path.join(os.path.dirname(path), PREFIX + os.path.basename(path))
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        if then is not None:
            then()
        return
    except OSError:
        trash = path  # not renamed (a leftover dot name in the way, say): removed where it is

    def run() -> None:
        try:
            shutil.rmtree(trash, ignore_errors=True)
        finally:
            try:
                if then is not None:
                    then()
            finally:
                with _lock:
                    _running.discard(threading.current_thread())

    thread = threading.Thread(target=run, name="remove-work", daemon=False)
    with _lock:
        _running.add(thread)
    try:
        thread.start()
    except RuntimeError:  # no thread to be had (interpreter shutting down): here and now
        with _lock:
            _running.discard(thread)
        run()


def drain(timeout: float | None = None) -> bool:
    """Wait for the removals in flight; True when none is left."""
    with _lock:
        threads = list(_running)
    for t in threads:
        t.join(timeout)
    with _lock:
        return not _running
