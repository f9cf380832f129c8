"""A CRIU still holding a container's tasks after its dump failed: stopped before the container is thawed.

When the ``runc checkpoint`` that runs CRIU dies (SIGKILL, OOM) CRIU is orphaned and goes on dumping,
its tasks seized; at its end it puts the cgroup freezer back as it found it, frozen by the agent: the
container the agent thawed meanwhile is frozen again, and nothing thaws it. Such a CRIU is found as the
tracer of a container's task (``TracerPid`` in /proc/PID/status, a process named ``criu``), killed, and
waited for: its tasks are released (a tracer's death detaches them) and it freezes nothing any more.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence


def tracer_of(pid: int) -> int:
    """The pid of the process tracing `pid` (0: none, or the task is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _is_criu(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == "criu"
    except OSError:
        return False


def stop_leftover_criu(pids: Sequence[int], timeout: float = 10.0) -> list[int]:
    """Kill the CRIU processes tracing any of `pids` and wait (up to `timeout`) until none traces them;
    returns the CRIU pids killed. A tracer that is not CRIU (a debugger) is left alone."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tracers = {t for t in (tracer_of(p) for p in pids) if t and _is_criu(t)}
        if not tracers:
            break
        for t in tracers - set(killed):
            with contextlib.suppress(ProcessLookupError):
                os.kill(t, signal.SIGKILL)
            killed.append(t)
        time.sleep(0.01)
    return killed
