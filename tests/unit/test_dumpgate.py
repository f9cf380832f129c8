"""The dump gate (shim/controller/dumpgate.py, issue 43): a slot from a save's freeze to the end of its
dump, freed for packaging and upload; the waiting save that ranks first gets it; too late: refused."""

from __future__ import annotations

import threading
import time

import pytest

from kubectl_snapshot.core import saveorder as O
from kubectl_snapshot.core.errors import FailedPrecondition
from shim.controller.dumpgate import DumpGate


def test_the_slot_is_held_from_freeze_to_upload_and_freed_at_the_end() -> None:
    gate = DumpGate(1)
    seen: list[str] = []
    with gate.phases(O.SaveRequest("a"), seen.append) as phase:
        phase("freeze")
        assert gate.held == 1
        phase("dump")
        assert gate.held == 1
        phase("upload")
        assert gate.held == 0
    assert seen == ["freeze", "dump", "upload"]
    with pytest.raises(RuntimeError), gate.phases(O.SaveRequest("b"), seen.append) as phase:
        phase("freeze")
        raise RuntimeError("the dump failed")
    assert gate.held == 0  # a failed save gives its slot back


def test_a_waiting_final_save_gets_the_slot_before_a_periodic_one() -> None:
    gate = DumpGate(1)
    gate.acquire(O.SaveRequest("holder"))
    got: list[str] = []

    def wait(req: O.SaveRequest) -> None:
        gate.acquire(req)
        got.append(req.pod)
        gate.release()

    periodic = threading.Thread(target=wait, args=(O.SaveRequest("periodic", O.PERIODIC),))
    periodic.start()
    time.sleep(0.1)
    final = threading.Thread(target=wait, args=(O.SaveRequest("final", O.URGENT, deadline=1e12),))
    final.start()
    time.sleep(0.1)
    gate.release()
    periodic.join(5)
    final.join(5)
    assert got == ["final", "periodic"]


def test_a_save_past_its_deadline_when_its_slot_comes_is_refused_before_the_freeze() -> None:
    gate = DumpGate(1, clock=lambda: 100.0)
    late = O.SaveRequest("a", O.URGENT, deadline=101.0)
    seen: list[str] = []
    with pytest.raises(FailedPrecondition, match="not frozen") as e, gate.phases(late, seen.append, name="s1") as phase:
        phase("freeze")
    assert "s1" in e.value.message and e.value.hint and seen == [] and gate.held == 0
