"""A CRIU left tracing a container's tasks after its runc died (threat A2): found by TracerPid, and only a
CRIU is stopped. The real case: tests/integration/test_criu_faults.py::
test_runc_killed_while_its_criu_holds_the_lock_leaves_none."""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading

from shim.criu.tracers import stop_leftover_criu, tracer_of

PTRACE_SEIZE = 0x4206


def test_an_untraced_or_gone_task_has_no_tracer() -> None:
    assert tracer_of(os.getpid()) == 0
    assert tracer_of(2**22 + 4321) == 0
    assert stop_leftover_criu([os.getpid(), 2**22 + 4321], timeout=0.2) == []


def test_a_debugger_that_is_not_criu_is_left_alone() -> None:
    """The legitimate case: a task traced by another program (here this test) keeps its tracer."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.ptrace(PTRACE_SEIZE, child.pid, None, None) == 0, ctypes.get_errno()
        assert tracer_of(child.pid) == threading.get_native_id()
        assert stop_leftover_criu([child.pid], timeout=0.2) == []
        assert tracer_of(child.pid) == threading.get_native_id() and child.poll() is None
    finally:
        child.kill()
        child.wait(10)
