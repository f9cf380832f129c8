"""What a CRIU dump that failed may leave, put right before the containers are thawed (threat A2).

Around the dumps (the engine's ``criu_lock`` port): when they fail, first a CRIU still holding the
containers' tasks is stopped (its ``runc checkpoint`` died: shim/criu/tracers.py), then the network lock
CRIU left in their namespaces is lifted (shim/net/criulock.py). The engine thaws the containers after.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

from shim.criu import tracers
from shim.net import criulock

log = logging.getLogger(__name__)


@contextlib.contextmanager
def cleaned_after_failure(pids: Sequence[int]) -> Iterator[list[str]]:
    with criulock.lifted_after_failure(pids) as lifted:  # left second: once no CRIU works on them any more
        try:
            yield lifted
        except BaseException:
            killed = tracers.stop_leftover_criu(pids)
            if killed:
                log.warning("stopped CRIU %s, still holding the containers after its dump failed", killed)
            raise
