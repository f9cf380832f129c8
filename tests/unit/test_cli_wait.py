"""The wait loop of `kubectl snapshot` (app/snapshot.wait_snapshot) over the shared fake API server: the
agent's status changes are scripted; a watch with nothing new runs until its timeout on the fake clock."""

from __future__ import annotations

import pytest

from kubectl_snapshot.app.snapshot import wait_snapshot
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, NotFound, Unavailable
from tests.support.fakeplugin import FakeKube, snapshot

UPLOADING = {"status": {"phase": "Running", "node": "n1", "stage": "upload"}}


def created() -> FakeKube:
    """PodSnapshot a/s just created: no agent has claimed it yet."""
    kube = FakeKube()
    kube.add(snapshot("s", "a"))
    return kube


def test_follows_status_to_success() -> None:
    kube = created()
    done = {"status": {"phase": "Succeeded", "stage": None, "reference": "r.io/x@sha256:" + "d" * 64}}
    kube.script(K.KIND, "a", "s", {"status": {"phase": "Running", "stage": "dump"}}, done)
    seen: list[str] = []
    final = wait_snapshot("a", "s", kube=kube, clock=kube.clock, on_status=lambda st: seen.append(st.stage or st.phase))
    assert final["status"]["reference"].endswith("d" * 64) and seen == ["", "dump", "Succeeded"]
    assert kube.clock.now == 0  # it returned as soon as the status said so


def test_unclaimed_snapshot_points_to_doctor() -> None:
    kube = created()
    with pytest.raises(Unavailable) as e:
        wait_snapshot("a", "s", kube=kube, clock=kube.clock, claim_timeout_s=60)
    assert "no kubectl-snapshot agent picked up" in e.value.message and "doctor" in (e.value.hint or "")
    assert 60 < kube.clock.now <= 80


def test_a_claimed_snapshot_is_not_cut_off_by_the_claim_timeout() -> None:
    kube = created()
    kube.script(K.KIND, "a", "s", UPLOADING)
    with pytest.raises(Unavailable, match="did not finish within 100s"):
        wait_snapshot("a", "s", kube=kube, clock=kube.clock, claim_timeout_s=20, timeout_s=100)
    assert kube.clock.now > 100


def test_failed_snapshot_carries_the_agents_hint_and_details() -> None:
    kube = created()
    failed = {"phase": "Failed", "node": "n1", "message": "CRIU failed", "hint": "see dump.log", "details": "log tail"}
    kube.script(K.KIND, "a", "s", {"status": failed})
    with pytest.raises(FailedPrecondition) as e:
        wait_snapshot("a", "s", kube=kube, clock=kube.clock)
    assert e.value.message == "snapshot a/s failed on node n1: CRIU failed" and e.value.hint == "see dump.log"
    assert e.value.details == "log tail"


def test_deleted_while_waiting_and_overall_timeout() -> None:
    kube = created()
    kube.script(K.KIND, "a", "s", UPLOADING, None)
    with pytest.raises(NotFound, match="was deleted while it was being taken"):
        wait_snapshot("a", "s", kube=kube, clock=kube.clock)
    kube = created()
    kube.script(K.KIND, "a", "s", UPLOADING)
    with pytest.raises(Unavailable, match="did not finish within 30s"):
        wait_snapshot("a", "s", kube=kube, clock=kube.clock, timeout_s=30)
