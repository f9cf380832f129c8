"""The staging gate (shim/engine/staging.py): a node-level restore creates its containers while their
data downloads; the hook's create waits until the agent answers, and never runs on incomplete data."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shim.engine.staging import FAILED, READY, StagingGate, StatePaths, wait_pod_staged, wait_staged


def test_a_container_no_agent_gated_is_not_held(tmp_path: Path) -> None:
    assert wait_staged(StatePaths(str(tmp_path)), "plain") is None
    assert wait_staged(StatePaths(str(tmp_path)), "../not-a-key") is None  # not a key the agent gates


def test_the_hook_waits_for_ready(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.staging_gate("c1"))
    timer = threading.Timer(0.2, gate.answer, args=(READY,))
    t = time.monotonic()
    timer.start()
    try:
        assert wait_staged(paths, "c1") is None
        assert time.monotonic() - t >= 0.19
    finally:
        timer.join()
        gate.close()
    assert not os.path.exists(paths.staging_gate("c1")) and not os.path.exists(paths.staging_gate("c1") + ".state")


def test_failed_staging_is_refused_with_its_reason(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.staging_gate("c1"))
    gate.answer(FAILED, "DigestMismatch: blob sha256:ab did not match")
    why = wait_staged(paths, "c1")
    gate.close()
    assert why is not None and "staging of this restore failed" in why and "DigestMismatch" in why


def test_an_agent_that_let_go_without_answering_is_not_waited_for(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.staging_gate("c1"))
    os.close(gate._fd)  # as when the agent dies: the kernel drops its lock
    t = time.monotonic()
    why = wait_staged(paths, "c1")
    assert why is not None and "let go before the data was complete" in why
    assert time.monotonic() - t < 5
    # the dead agent's gate is gone: the next create of that id is not held up
    assert not os.path.exists(paths.staging_gate("c1"))
    assert wait_staged(paths, "c1") is None


def test_ready_just_before_letting_go_counts(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.staging_gate("c1"))
    gate.answer(READY)
    os.close(gate._fd)
    assert wait_staged(paths, "c1") is None


def test_a_slow_staging_is_given_up_at_the_deadline(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.staging_gate("c1"))
    t = time.monotonic()
    try:
        why = wait_staged(paths, "c1", timeout_s=0.3)
    finally:
        gate.close()
    assert why is not None and "not complete within 0.3 s" in why and 0.29 <= time.monotonic() - t < 5


def test_an_answer_left_by_a_dead_agent_does_not_answer_the_next_restore(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    Path(paths.staging_gate("c1")).parent.mkdir(parents=True)
    Path(paths.staging_gate("c1") + ".state").write_text("ready\n")
    gate = StagingGate(paths.staging_gate("c1"))
    try:
        why = wait_staged(paths, "c1", timeout_s=0.2)
    finally:
        gate.close()
    assert why is not None and "not complete" in why


# --- the agent's early create (shim/engine/restore.py) over a stand-in for _create_all ---------------


def _early(paths: StatePaths, monkeypatch: pytest.MonkeyPatch, create: Callable[[], list[tuple[str, int]]]) -> Any:
    from shim.engine import restore as R

    monkeypatch.setattr(R, "_create_all", lambda *a, **k: create())
    req = SimpleNamespace(new_ids=["c1"])
    return R._EarlyCreate.start(None, req, None, [], "ns", paths, time.monotonic)  # type: ignore[arg-type]


def test_early_create_waits_at_the_gate_and_returns_what_was_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = StatePaths(str(tmp_path))
    seen: list[str | None] = []

    def create() -> list[tuple[str, int]]:
        seen.append(wait_staged(paths, "c1"))  # as the hook does
        return [("c1", 42)]

    early = _early(paths, monkeypatch, create)
    time.sleep(0.05)
    assert seen == []  # still waiting: nothing was answered
    assert early.finish() == [("c1", 42)] and seen == [None]
    assert not os.path.exists(paths.staging_gate("c1"))


def test_early_create_refused_when_staging_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = StatePaths(str(tmp_path))
    seen: list[str | None] = []

    def create() -> list[tuple[str, int]]:
        why = wait_staged(paths, "c1")
        seen.append(why)
        raise RuntimeError(why)

    early = _early(paths, monkeypatch, create)
    early.abandon("DigestMismatch: bad blob")
    assert seen and seen[0] is not None and "DigestMismatch" in seen[0]
    assert not os.path.exists(paths.staging_gate("c1"))


def test_a_creation_given_up_before_the_data_was_complete_is_done_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def create() -> list[tuple[str, int]]:
        raise RuntimeError("the staged data was not complete within 60 s")

    early = _early(StatePaths(str(tmp_path)), monkeypatch, create)
    early.thread.join()
    assert early.finish() is None  # the caller creates the containers again, after the download


def test_a_creation_failing_after_the_data_was_complete_is_the_restores_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = StatePaths(str(tmp_path))

    def create() -> list[tuple[str, int]]:
        assert wait_staged(paths, "c1") is None
        raise RuntimeError("criu restore failed")

    early = _early(paths, monkeypatch, create)
    with pytest.raises(RuntimeError, match="criu restore failed"):
        early.finish()


def test_a_gate_another_restore_holds_is_not_taken(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    first = StagingGate(paths.staging_gate("c1"))
    try:
        with pytest.raises(OSError):
            StagingGate(paths.staging_gate("c1"))  # the agent then creates the containers after the download, as before
        first.answer(READY)
        assert wait_staged(paths, "c1") is None  # the second attempt removed nothing of the first's
    finally:
        first.close()


# --- pod gates: the kubelet creates a restored pod's containers while its save downloads -------------

UID = "0b8f6c2e-1111-2222-3333-444455556666"


def test_a_pod_container_no_agent_gated_is_not_held(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    assert wait_pod_staged(paths, UID, "app") is None
    assert wait_pod_staged(paths, UID, "../app") is None  # not a key the agent gates


def test_a_pod_gate_answers_every_create_of_its_container(tmp_path: Path) -> None:
    """The kubelet creates a container again after a refused create or a restart: same answer."""
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.pod_gate(UID, "app"))
    timer = threading.Timer(0.2, gate.answer, args=(FAILED, "DigestMismatch: blob sha256:ab"))
    t = time.monotonic()
    timer.start()
    try:
        why = wait_pod_staged(paths, UID, "app")
    finally:
        timer.join()
        gate.release()
    assert time.monotonic() - t >= 0.19
    assert why is not None and "staging of this restore failed" in why and "DigestMismatch" in why
    assert os.path.exists(paths.pod_gate(UID, "app"))  # kept: released, not removed
    again = wait_pod_staged(paths, UID, "app", timeout_s=0.5)
    assert again == why
    assert wait_pod_staged(paths, UID, "other") is None  # gates are per container


def test_a_pod_gate_whose_agent_died_waits_for_the_agent_that_stages_again(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    first = StagingGate(paths.pod_gate(UID, "app"))
    result: list[str | None] = []
    hook = threading.Thread(target=lambda: result.append(wait_pod_staged(paths, UID, "app", timeout_s=10)))
    hook.start()
    time.sleep(0.1)
    os.close(first._fd)  # the agent dies while staging: the kernel drops its lock, no answer
    time.sleep(0.6)
    assert hook.is_alive()  # not refused: a successor stages the pod again
    second = StagingGate(paths.pod_gate(UID, "app"))
    second.answer(READY)
    hook.join(5)
    second.release()
    assert result == [None]


def test_a_pod_gate_whose_agent_died_is_refused_at_the_deadline(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.pod_gate(UID, "app"))
    os.close(gate._fd)
    why = wait_pod_staged(paths, UID, "app", timeout_s=0.5)
    assert why is not None and "no agent took it up again" in why
    assert os.path.exists(paths.pod_gate(UID, "app"))  # not removed: the next create waits again


def test_a_slow_pod_staging_is_refused_at_the_deadline(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.pod_gate(UID, "app"))
    try:
        why = wait_pod_staged(paths, UID, "app", timeout_s=0.3)
    finally:
        gate.release()
    assert why is not None and "not complete within 0.3 s" in why


def test_the_restore_worker_gates_every_container_but_the_gate() -> None:
    from kubectl_snapshot.core import kube as K
    from shim.controller.restores import gated_containers

    pod = {
        "spec": {
            "initContainers": [{"name": K.GATE_CONTAINER}, {"name": "setup"}],
            "containers": [{"name": "app"}, {"name": "sidecar"}],
        }
    }
    assert gated_containers(pod) == ["setup", "app", "sidecar"]


def test_pod_gates_are_answered_once_and_kept(tmp_path: Path) -> None:
    from shim.controller.restores import _PodGates

    paths = StatePaths(str(tmp_path))
    gates = _PodGates()
    gates.take(paths, UID, ["app", "sidecar"])
    with pytest.raises(OSError):
        StagingGate(paths.pod_gate(UID, "app"))  # held while staging
    gates.answer(READY, "no restore: the save was refused")
    gates.answer(FAILED, "too late")  # the worker's final word changes nothing already answered
    assert wait_pod_staged(paths, UID, "app") is None and wait_pod_staged(paths, UID, "sidecar") is None
