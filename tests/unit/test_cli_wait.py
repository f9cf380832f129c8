"""The wait loops of `kubectl snapshot` and `restore` (pure logic over a scripted watch: a fake of the port)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kubectl_snapshot.app.snapshot import wait_snapshot
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, Unavailable


class ScriptedWatch:
    """Answers each watch call with the next batch of events; advances a fake clock per call."""

    def __init__(self, batches: list[list[tuple[str, dict[str, Any]]]], step_s: float = 10) -> None:
        self.batches, self.now, self.step_s = batches, 0.0, step_s

    def clock(self) -> float:
        return self.now

    def watch_snapshot(self, ns: str, name: str, timeout_s: int = 300) -> Iterator[tuple[str, dict[str, Any]]]:
        self.now += self.step_s
        yield from (self.batches.pop(0) if self.batches else [])

    def get_snapshot(self, ns: str, name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}}


def _obj(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "s"}, "status": status}


def test_follows_status_to_success() -> None:
    seen: list[str] = []
    w = ScriptedWatch(
        [
            [("ADDED", _obj())],
            [("MODIFIED", _obj(phase="Running", stage="dump")), ("MODIFIED", _obj(phase="Succeeded", reference="r@d"))],
        ]
    )
    final = wait_snapshot("a", "s", kube=w, clock=w.clock, on_status=lambda st: seen.append(st.stage or st.phase))  # type: ignore[arg-type]
    assert final["status"]["reference"] == "r@d" and seen == ["", "dump", "Succeeded"]


def test_unclaimed_snapshot_points_to_doctor() -> None:
    w = ScriptedWatch([[("ADDED", _obj())]] * 20)
    with pytest.raises(Unavailable) as e:
        wait_snapshot("a", "s", kube=w, clock=w.clock, claim_timeout_s=60)  # type: ignore[arg-type]
    assert "no kubectl-snapshot agent picked up" in e.value.message and "doctor" in (e.value.hint or "")
    assert 60 < w.now <= 80


def test_failed_snapshot_carries_the_agents_hint_and_details() -> None:
    failed = _obj(phase="Failed", node="n1", message="CRIU failed", hint="see dump.log", details="log tail")
    w = ScriptedWatch([[("ADDED", failed)]])
    with pytest.raises(FailedPrecondition) as e:
        wait_snapshot("a", "s", kube=w, clock=w.clock)  # type: ignore[arg-type]
    assert e.value.message == "snapshot a/s failed on node n1: CRIU failed" and e.value.hint == "see dump.log"
    assert e.value.details == "log tail"


def test_deleted_while_waiting_and_overall_timeout() -> None:
    w = ScriptedWatch([[("DELETED", _obj())]])
    with pytest.raises(NotFound):
        wait_snapshot("a", "s", kube=w, clock=w.clock)  # type: ignore[arg-type]
    w = ScriptedWatch([[("ADDED", _obj(phase="Running", stage="upload"))]] * 100)
    with pytest.raises(Unavailable, match="did not finish within 30s"):
        wait_snapshot("a", "s", kube=w, clock=w.clock, timeout_s=30)  # type: ignore[arg-type]
