"""Issue 10 item 6: a status write that fails after the push never reports a stopped pod as running.

The agent keeps the result on its node before writing it, retries the write, and writes it later
(periodically, or as the next agent after a restart) instead of the "agent restarted, pod keeps
running" failure. Fake of the Kubernetes port; real state dir in tmp_path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import Unavailable
from kubectl_snapshot.core.model import HostFacts, SnapshotConfig
from kubectl_snapshot.core.reference import Reference
from shim.controller import snapshots as S
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import SnapshotWorker
from shim.engine.publish import CheckpointResult
from tests.support.fakekube import StrictKube


@dataclass
class FlakyKube(StrictKube):
    failures: int  # status writes that fail before the API server answers again
    objects: list[dict[str, Any]] = field(default_factory=list)
    written: list[dict[str, Any]] = field(default_factory=list)

    def patch_snapshot_status(self, ns: str, name: str, status: dict[str, Any], **kw: Any) -> dict[str, Any]:
        if self.failures > 0:
            self.failures -= 1
            raise Unavailable("the API server is not answering")
        self.written.append(status)
        return {}

    def create_event(self, ns: str, **kw: Any) -> dict[str, Any]:
        return {}

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.objects


OBJ = {
    "metadata": {"name": "s1", "namespace": "a", "uid": "0f7c-uid", "resourceVersion": "9"},
    "spec": {"podName": "p", "destination": "127.0.0.1:5000/x", "stop": True},
    "status": {"phase": K.PHASE_RUNNING, "node": "n1"},
}
POD = {"metadata": {"name": "p", "namespace": "a", "uid": "pod-uid"}}


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(S, "RESULT_RETRY_S", (0.0, 0.0))


def result() -> CheckpointResult:
    ref = Reference.parse("127.0.0.1:5000/x@sha256:" + "d" * 64)
    cfg = SnapshotConfig(group="p", namespace="a", created="", containers=(), host=HostFacts(), stopped=True)
    return CheckpointResult(
        reference=ref, tagged=Reference.parse("127.0.0.1:5000/x:v1"), config=cfg, size=1, uploaded=1
    )


def worker(kube: FlakyKube, tmp_path: Path) -> SnapshotWorker:
    return SnapshotWorker(kube=kube, settings=NodeSettings(node="n1", state_root=str(tmp_path)), facts=HostFacts())


def test_a_short_outage_is_retried(tmp_path: Path) -> None:
    kube = FlakyKube(failures=2)
    worker(kube, tmp_path)._finish_ok(OBJ, POD, result())
    assert [w["phase"] for w in kube.written] == [K.PHASE_SUCCEEDED]
    assert not (tmp_path / "n1" / "results" / "0f7c-uid.json").exists()


def test_after_a_long_outage_the_next_agent_writes_the_real_result(tmp_path: Path) -> None:
    kube = FlakyKube(failures=100)
    worker(kube, tmp_path)._finish_ok(OBJ, POD, result())
    assert kube.written == []
    assert (tmp_path / "n1" / "results" / "0f7c-uid.json").exists()
    # the agent restarts; the API server answers again; the object still says Running on this node
    kube.failures = 0
    worker(kube, tmp_path).consider(OBJ)
    assert len(kube.written) == 1
    assert kube.written[0]["phase"] == K.PHASE_SUCCEEDED and kube.written[0]["reference"].endswith("d" * 64)
    assert not (tmp_path / "n1" / "results" / "0f7c-uid.json").exists()


def test_the_periodic_pass_writes_pending_results(tmp_path: Path) -> None:
    kube = FlakyKube(failures=100, objects=[OBJ])
    w = worker(kube, tmp_path)
    w._finish_ok(OBJ, POD, result())
    kube.failures = 0
    w.flush_results()
    assert [x["phase"] for x in kube.written] == [K.PHASE_SUCCEEDED]


def test_without_a_result_a_stop_snapshot_is_not_said_to_keep_running(tmp_path: Path) -> None:
    kube = FlakyKube(failures=0)
    worker(kube, tmp_path).consider(OBJ)
    msg = kube.written[-1]["message"]
    assert kube.written[-1]["phase"] == K.PHASE_FAILED
    assert "keeps running" not in msg and "may have been stopped" in msg
