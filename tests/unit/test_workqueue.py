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


# --- several workers (issue 43) ------------------------------------------------------------------------

import time  # noqa: E402

from kubectl_snapshot.core import saveorder as O  # noqa: E402


def test_several_workers_run_saves_at_once() -> None:
    q = WorkQueue("t", workers=3)
    started, gate = threading.Barrier(3, timeout=10), threading.Event()
    for i in range(3):
        q.submit(lambda: (started.wait(), gate.wait(10)), order=O.SaveRequest(f"pod{i}", O.URGENT, deadline=1e12))
    time.sleep(0.2)
    assert q.running == 3  # all three met at the barrier: they ran together
    gate.set()


def test_a_final_save_is_taken_before_periodic_ones_that_waited_longer() -> None:
    q = WorkQueue("t", workers=2)
    order: list[str] = []
    gate, done = threading.Event(), threading.Event()
    q.submit(lambda: gate.wait(10), order=O.SaveRequest("busy", O.PERIODIC))  # holds the one ordinary worker
    while q.running == 0:
        time.sleep(0.01)
    for i in range(3):
        q.submit(lambda i=i: order.append(f"periodic{i}"), order=O.SaveRequest(f"p{i}", O.PERIODIC))  # type: ignore[misc]
    q.submit(lambda: order.append("final"), order=O.SaveRequest("f", O.URGENT, deadline=time.time() + 60))
    time.sleep(0.3)
    assert order == ["final"]  # on the worker kept for final saves, while the periodic ones wait
    q.submit(done.set, order=O.SaveRequest("last", O.PERIODIC))
    gate.set()
    assert done.wait(10)
    assert order == ["final", "periodic0", "periodic1", "periodic2"]


def test_two_saves_of_one_pod_never_overlap_and_a_newer_periodic_supersedes_the_waiting_one() -> None:
    q = WorkQueue("t", workers=3)
    gate, done = threading.Event(), threading.Event()
    ran: list[str] = []
    dropped: list[str] = []

    def first() -> None:
        gate.wait(10)
        ran.append("first")

    q.submit(first, order=O.SaveRequest("a", O.USER))
    while q.running == 0:
        time.sleep(0.01)
    q.submit(lambda: ran.append("old"), order=O.SaveRequest("a", O.PERIODIC), on_drop=dropped.append)

    def new() -> None:
        ran.append("new")
        done.set()

    q.submit(new, order=O.SaveRequest("a", O.PERIODIC))
    time.sleep(0.2)
    assert ran == [] and q.length == 1 and q.running == 1  # the pod's second save waits for its first
    assert len(dropped) == 1 and "superseded" in dropped[0]
    gate.set()
    assert done.wait(10)
    assert ran == ["first", "new"]


def test_a_final_save_whose_deadline_comes_while_it_waits_is_dropped_and_told_why() -> None:
    now = [1000.0]
    q = WorkQueue("t", workers=1, clock=lambda: now[0])
    gate = threading.Event()
    dropped: list[str] = []
    q.submit(lambda: gate.wait(10), order=O.SaveRequest("a", O.USER))
    while q.running == 0:
        time.sleep(0.01)
    q.submit(lambda: None, order=O.SaveRequest("b", O.URGENT, deadline=1010.0), on_drop=dropped.append)
    time.sleep(0.1)
    now[0] = 1009.5
    gate.set()
    deadline = time.time() + 5
    while not dropped and time.time() < deadline:
        time.sleep(0.05)
    assert dropped and "thaw_by" in dropped[0] and "never frozen" in dropped[0]
    assert q.length == 0
