"""The agent's snapshot queue (shim/controller/workqueue.py): one job at a time, in order, a failing job
does not stop the queue, and its length is reported as it changes."""

from __future__ import annotations

import threading

from shim.controller.workqueue import WorkQueue


def test_jobs_run_one_at_a_time_in_order_and_the_length_is_reported() -> None:
    lengths: list[int] = []
    q = WorkQueue("t", on_length=lengths.append)
    gate, done = threading.Event(), threading.Event()
    ran: list[int] = []

    def job(i: int) -> None:
        if i == 0:
            gate.wait(10)
        if i == 2:
            raise RuntimeError("a bug in one job")
        ran.append(i)
        if i == 3:
            done.set()

    for i in range(4):
        q.submit(lambda i=i: job(i))  # type: ignore[misc]
    assert q.length >= 3  # the first may have started; the others wait behind it
    gate.set()
    assert done.wait(10)
    assert ran == [0, 1, 3] and q.length == 0
    assert max(lengths) >= 3 and lengths[-1] == 0


def test_inline_runs_in_the_callers_thread() -> None:
    q = WorkQueue.inline()
    seen: list[str | None] = []
    q.submit(lambda: seen.append(threading.current_thread().name))
    assert seen == [threading.current_thread().name] and q.length == 0
