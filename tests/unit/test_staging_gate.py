"""The staging gate (shim/engine/staging.py): a node-level restore creates its containers while their
data downloads; the hook's create waits until the agent answers, and never runs on incomplete data."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shim.engine.staging import (
    FAILED,
    READY,
    PendingPages,
    StagingGate,
    StatePaths,
    pages_gate,
    wait_pod_staged,
    wait_staged,
    wait_staged_images,
)


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


def test_the_hook_prepares_while_it_waits_only_where_there_is_a_gate(tmp_path: Path) -> None:
    """`meanwhile` (the hook loads the image check's code) runs during the wait, not after it; never for
    an ungated create or a gate already let go; its failure does not change the answer; the deadline
    counts its time too."""
    paths = StatePaths(str(tmp_path))
    ran: list[bool] = []
    gate = StagingGate(paths.staging_gate("c1"))
    timer = threading.Timer(1.0, gate.answer, args=(READY,))
    timer.start()
    try:
        assert wait_staged(paths, "c1", meanwhile=lambda: ran.append(gate.answered)) is None
    finally:
        timer.join()
        gate.close()
    assert ran == [False]  # before the agent answered
    assert wait_staged(paths, "plain", meanwhile=lambda: ran.append(True)) is None and ran == [False]

    def broken() -> None:
        raise ImportError("no module named shim.criu.guard")

    gate = StagingGate(paths.staging_gate("c2"))
    gate.answer(READY)
    os.close(gate._fd)  # answered and let go: passed at once, nothing prepared
    assert wait_staged(paths, "c2", meanwhile=lambda: ran.append(True)) is None and ran == [False]
    gate = StagingGate(paths.staging_gate("c4"))
    threading.Timer(0.2, gate.answer, args=(READY,)).start()
    try:
        assert wait_staged(paths, "c4", meanwhile=broken) is None
    finally:
        gate.close()
    slow = StagingGate(paths.staging_gate("c3"))
    t = time.monotonic()
    try:  # the deadline counts the meanwhile's 1.5 s: given up then, not at 1.5 + 1.0 s
        why = wait_staged(paths, "c3", timeout_s=1.0, meanwhile=lambda: time.sleep(1.5))
    finally:
        slow.close()
    assert why is not None and 1.49 <= time.monotonic() - t < 2.3, why


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
    from kubectl_snapshot.core import kubenames as K
    from shim.controller.restores import gated_containers

    pod = {
        "spec": {
            "initContainers": [{"name": K.GATE_CONTAINER}, {"name": "setup"}],
            "containers": [{"name": "app"}, {"name": "sidecar"}],
        }
    }
    assert gated_containers(pod) == ["setup", "app", "sidecar"]
    # a resuming pod without the gate init container whose app container is named like it: held too
    # (the wrapper waits on a gate the agent took; it only does not wait for that name's to appear)
    gateless = {"spec": {"containers": [{"name": "app"}, {"name": K.GATE_CONTAINER}]}}
    assert gated_containers(gateless) == ["app", K.GATE_CONTAINER]


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


# --- a resuming pod without a gate init container: the hook waits for the agent to take its gates ----


def test_a_resuming_pods_container_waits_for_its_gate_to_appear(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    result: list[str | None] = []
    hook = threading.Thread(target=lambda: result.append(wait_pod_staged(paths, UID, "app", expected=True)))
    hook.start()
    time.sleep(0.3)
    assert hook.is_alive()  # no gate yet: the agent has not seen the pod
    gate = StagingGate(paths.pod_gate(UID, "app"))
    time.sleep(0.2)
    assert hook.is_alive()  # taken, not answered
    gate.answer(READY)
    gate.release()
    hook.join(5)
    assert result == [None]


def test_a_resuming_pod_no_agent_takes_up_is_refused_at_the_deadline(tmp_path: Path) -> None:
    why = wait_pod_staged(StatePaths(str(tmp_path)), UID, "app", expected=True, timeout_s=0.3)
    assert why is not None and "did not take up this pod's restore within 0.3 s" in why


def test_the_hook_expects_a_gate_only_for_a_resuming_pods_containers() -> None:
    from kubectl_snapshot.core import kubenames as K
    from shim.runtime_wrapper import resuming

    assert resuming({"annotations": {K.ANN_RESUME_POLICY: "p"}}, "app")
    assert not resuming({"annotations": {K.ANN_RESUME_POLICY: "p"}}, K.GATE_CONTAINER)  # a gated pod's own gate
    assert not resuming({"annotations": {}}, "app") and not resuming({}, "app")


def test_the_hook_waits_for_the_gate_of_a_resuming_or_restore_pods_containers_only() -> None:
    """A restore pod goes without the gate init container (core/podspec.gate_needed): its containers wait for
    the agent at their create, as a resuming pod's do; an ordinary pod's create never waits."""
    from kubectl_snapshot.core import kubenames as K
    from shim.runtime_wrapper import held

    restore = {"annotations": {K.ANN_RESTORE_FROM: "reg/r@sha256:" + "a" * 64}}
    assert held(restore, "app") and held({"annotations": {K.ANN_RESUME_POLICY: "p"}}, "app")
    assert not held(restore, K.GATE_CONTAINER)  # a gated restore pod's gate waits for the agent by itself
    assert not held({"annotations": {"other": "x"}}, "app") and not held({}, "app")


class _Kube:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.events: list[tuple[str, str]] = []

    def patch_pod_annotations(self, ns: str, name: str, annotations: dict[str, Any], *, status: bool = False) -> Any:
        self.patches.append(annotations)
        return {}

    def create_event(self, ns: str, *, involved: Any, reason: str, message: str, **_: Any) -> Any:
        self.events.append((reason, message))
        return {}


def _resuming_pod(**status: Any) -> dict[str, Any]:
    from kubectl_snapshot.core import kubenames as K

    return {
        "metadata": {"name": "web-0", "namespace": "ns", "uid": UID, "annotations": {K.ANN_RESUME_POLICY: "p"}},
        "spec": {"nodeName": "n1", "containers": [{"name": "app"}, {"name": "side"}]},
        "status": status,
    }


def _worker(tmp_path: Path) -> Any:
    from kubectl_snapshot.core.model import HostFacts
    from shim.controller.restores import RestoreWorker
    from shim.controller.settings import NodeSettings

    kube = _Kube()
    settings = NodeSettings(node="n1", state_root=str(tmp_path / "state"), kubelet_root=str(tmp_path / "k"))
    return RestoreWorker(kube=kube, settings=settings, facts=HostFacts()), kube  # type: ignore[arg-type]


def test_a_resuming_pod_with_no_save_has_its_containers_let_go_fresh(tmp_path: Path) -> None:
    from kubectl_snapshot.core import kubenames as K
    from shim.controller.resume_source import StartFresh

    worker, kube = _worker(tmp_path)
    seen: list[str | None] = []

    def source(pod: dict[str, Any]) -> StartFresh:
        # while the agent chooses, the containers the kubelet creates wait at their gates
        for name in ("app", "side"):
            assert os.path.exists(worker.paths.pod_gate(UID, name))
        return StartFresh("no save of this pod yet")

    assert worker.stage(_resuming_pod(), source)
    for name in ("app", "side"):
        seen.append(wait_pod_staged(worker.paths, UID, name, expected=True, timeout_s=1))
    assert seen == [None, None]
    assert kube.patches[-1][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_SKIPPED_PREFIX)


def test_a_resuming_pod_whose_containers_already_run_starts_fresh_and_is_not_held(tmp_path: Path) -> None:
    """A node whose containerd does not pass the annotation yet ran the containers at once: no staging
    into a running pod, and its containers' later creates are not held."""
    from kubectl_snapshot.core import kubenames as K

    worker, kube = _worker(tmp_path)

    def source(pod: dict[str, Any]) -> Any:
        raise AssertionError("no save is chosen for a pod that already runs")

    running = _resuming_pod(
        containerStatuses=[{"name": "app", "containerID": "containerd://x", "state": {"running": {}}}]
    )
    assert worker.stage(running, source)
    assert wait_pod_staged(worker.paths, UID, "app", expected=True, timeout_s=1) is None
    assert "started before this node's agent took up the resume" in kube.patches[-1][K.ANN_RESTORE_STATUS]


def test_an_agent_that_stages_a_resuming_pod_again_drops_what_its_predecessor_left(tmp_path: Path) -> None:
    """The containers wait in the wrapper's create (created, not started): not mistaken for started,
    and a half-staged save of the dead agent is never restored: the pod starts fresh here."""
    from shim.controller.resume_source import StartFresh

    worker, kube = _worker(tmp_path)
    half = Path(worker.paths.staged_by_pod(UID, "app")) / "checkpoint"
    half.mkdir(parents=True)
    refused = {"terminated": {"exitCode": 128, "reason": "StartError", "startedAt": None}}
    waiting = _resuming_pod(
        containerStatuses=[
            {"name": "app", "containerID": "containerd://x", "state": {"waiting": {}}, "lastState": refused}
        ]
    )
    assert worker.stage(waiting, lambda pod: StartFresh("the save is gone"))
    assert not half.exists()
    assert wait_pod_staged(worker.paths, UID, "app", expected=True, timeout_s=1) is None
    assert "the save is gone" in str(kube.patches[-1])


def test_a_resuming_pod_with_a_gate_init_container_and_no_save_lets_its_containers_go_fresh(tmp_path: Path) -> None:
    """Pods never restarted resume through the gate init container (deploy/resume.py); their app
    containers still carry the resume annotation, so the wrapper waits for their gates to appear: the
    agent takes them first and answers them when it starts the pod fresh, as for a pod without one."""
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.podspec import gate_container
    from shim.controller.podinfo import empty_dir_rel
    from shim.controller.resume_source import StartFresh

    worker, kube = _worker(tmp_path)
    pod = _resuming_pod()
    pod["spec"]["initContainers"] = [gate_container("reg.example/agent:1")]  # as the admission policy adds it
    pod["spec"]["volumes"] = [{"name": K.GATE_VOLUME, "emptyDir": {}}]
    gate_dir = tmp_path / "k" / empty_dir_rel(UID, K.GATE_VOLUME)
    gate_dir.mkdir(parents=True)

    def source(pod: dict[str, Any]) -> StartFresh:
        for name in ("app", "side"):  # held from the start, not only once a save is being staged
            assert os.path.exists(worker.paths.pod_gate(UID, name))
        return StartFresh("no save of this pod yet")

    assert worker.stage(pod, source)
    assert (gate_dir / K.GATE_STAGED_FILE).read_text().startswith("no restore: no save of this pod yet")
    for name in ("app", "side"):
        assert wait_pod_staged(worker.paths, UID, name, expected=True, timeout_s=1) is None
    assert kube.patches[-1][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_SKIPPED_PREFIX)


def test_a_restore_pod_whose_gates_cannot_be_taken_fails_and_its_gate_says_why(tmp_path: Path) -> None:
    """Taken first now: a failure to take them still reaches the gate init container (it exits with it)."""
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.podspec import gate_container
    from shim.controller.podinfo import empty_dir_rel

    worker, kube = _worker(tmp_path)
    pod = _resuming_pod()
    pod["metadata"]["annotations"] = {K.ANN_RESTORE_FROM: "reg.example/ns/app@sha256:" + "a" * 64}
    pod["spec"]["initContainers"] = [gate_container("reg.example/agent:1")]
    pod["spec"]["volumes"] = [{"name": K.GATE_VOLUME, "emptyDir": {}}]
    gate_dir = tmp_path / "k" / empty_dir_rel(UID, K.GATE_VOLUME)
    gate_dir.mkdir(parents=True)
    held = StagingGate(worker.paths.pod_gate(UID, "app"))  # as if another staging held it
    try:
        assert not worker.stage(pod, lambda p: (_ for _ in ()).throw(AssertionError("no save is chosen")))
    finally:
        held.release()
    assert (gate_dir / K.GATE_FAILED_FILE).exists()
    assert kube.patches[-1][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_FAILED_PREFIX)


# --- two phases: the CRIU images first, the page files at the pages gate -------------------------------


@contextlib.contextmanager
def images_announced(paths: StatePaths, timeout_s: float = 60.0) -> Iterator[tuple[StagingGate, PendingPages]]:
    """The agent's two-phase gate of container c1 with the images announced, and the hook's view of it."""
    gate = StagingGate(paths.staging_gate("c1"), two_phase=True)
    try:
        gate.answer_images()
        why, pending = wait_staged_images(paths, "c1", timeout_s=timeout_s)
        assert why is None and pending is not None
        yield gate, pending
    finally:
        gate.close()


def test_a_two_phase_gate_announces_the_images_then_the_pages(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    with images_announced(paths, timeout_s=5) as (gate, pending):
        assert pending.gate == pages_gate(paths.staging_gate("c1"))
        assert time.time() < pending.deadline <= time.time() + 5
        assert pending.failure() is None  # nothing said about the pages yet
        timer = threading.Timer(0.2, gate.answer, args=(READY,))
        t = time.monotonic()
        timer.start()
        assert pending.wait() is None
        assert time.monotonic() - t >= 0.19  # it waited for the page files' answer
        timer.join()
        assert wait_staged(paths, "c1") is None  # a later look: complete
    assert os.listdir(os.path.dirname(paths.staging_gate("c1"))) == []  # both gates and both answers removed


def test_staging_that_fails_after_the_images_fails_the_pages_gate(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    with images_announced(paths) as (gate, pending):
        gate.answer(FAILED, "DigestMismatch: chunk sha256:ab did not match")
        for why in (pending.wait(), pending.failure(), wait_staged(paths, "c1")):
            assert why is not None and "DigestMismatch" in why


def test_an_agent_that_dies_between_the_phases_refuses_the_restore(tmp_path: Path) -> None:
    with images_announced(StatePaths(str(tmp_path))) as (gate, pending):
        gate.release()  # the kernel lets go of a dead agent's locks; no answer at the pages gate
        why = pending.wait()
        assert why is not None and "let go before the page files were complete" in why
        assert pending.failure() is None


def test_the_pages_wait_keeps_the_first_phases_deadline(tmp_path: Path) -> None:
    with images_announced(StatePaths(str(tmp_path)), timeout_s=0.3) as (_, pending):
        t = time.monotonic()
        why = pending.wait()
        assert why is not None and "not complete in time" in why
        assert time.monotonic() - t < 2


def test_a_one_phase_gate_ignores_the_images_announcement(tmp_path: Path) -> None:
    """Pod gates (and a gate whose pages were there in time) answer once; answer_images does nothing."""
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths.staging_gate("c1"))
    try:
        gate.answer_images()
        assert not gate.images_answered
        gate.answer(READY)
        assert wait_staged_images(paths, "c1") == (None, None)
        assert not os.path.exists(pages_gate(paths.staging_gate("c1")))
    finally:
        gate.close()


def test_a_second_two_phase_gate_of_the_same_id_is_refused(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    first = StagingGate(paths.staging_gate("c1"), two_phase=True)
    try:
        with pytest.raises(OSError):
            StagingGate(paths.staging_gate("c1"), two_phase=True)
        first.answer_images()
        with pytest.raises(OSError):  # the pages lock is still held
            StagingGate(paths.staging_gate("c1"), two_phase=True)
        why, pending = wait_staged_images(paths, "c1")  # the first's answer is untouched
        assert why is None and pending is not None
    finally:
        first.close()


def test_a_failed_restore_waits_briefly_for_the_agents_reason(tmp_path: Path) -> None:
    """CRIU can fail before the agent answers (a failed staging removes the staged dir first): the hook
    waits a little for the reason, and not at all once the gate is free."""
    with images_announced(StatePaths(str(tmp_path))) as (gate, pending):
        timer = threading.Timer(0.3, gate.answer, args=(FAILED, "DigestMismatch: chunk sha256:ab"))
        timer.start()
        assert pending.failure() is None  # not yet said
        why = pending.failure(wait_s=5)
        timer.join()
        assert why is not None and "DigestMismatch" in why
        t = time.monotonic()
        assert pending.failure(wait_s=5) == why and time.monotonic() - t < 1  # a free gate: at once


# --- a restore pod without the gate init container (core/podspec.gate_needed) -------------------------


def _gateless_restore_pod(**status: Any) -> dict[str, Any]:
    from kubectl_snapshot.core import kubenames as K

    pod = _resuming_pod(**status)
    pod["metadata"]["annotations"] = {
        K.ANN_RESTORE_FROM: "reg.example/snaps@sha256:" + "a" * 64,
        K.ANN_RESTORE_MODE: K.RESTORE_MODE_LAZY,
    }
    return pod


def test_a_gateless_restore_pods_containers_are_held_while_the_agent_stages_it(tmp_path: Path) -> None:
    """Its gates are taken before the snapshot is read (the wrapper waits for them to appear), and a
    restore that fails answers them with the reason: the create is refused, nothing runs from the image."""
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.errors import Unavailable

    worker, kube = _worker(tmp_path)

    def source(pod: dict[str, Any]) -> Any:
        for name in ("app", "side"):
            assert os.path.exists(worker.paths.pod_gate(UID, name))
        raise Unavailable("registry reg.example is not reachable")

    assert not worker.stage(_gateless_restore_pod(), source)
    why = wait_pod_staged(worker.paths, UID, "app", expected=True, timeout_s=1)
    assert why is not None and "registry reg.example is not reachable" in why
    assert kube.patches[-1][K.ANN_RESTORE_STATUS] == K.RESTORE_FAILED_PREFIX + "registry reg.example is not reachable"


def test_a_gateless_restore_pod_whose_container_already_runs_is_refused_not_restored(tmp_path: Path) -> None:
    """A node whose containerd does not pass the restore annotation ran the container from its image:
    the restore fails with why (a resume would start fresh; a restore must not look done)."""
    from kubectl_snapshot.core import kubenames as K

    worker, kube = _worker(tmp_path)

    def source(pod: dict[str, Any]) -> Any:
        raise AssertionError("no snapshot is read for a pod that already runs")

    running = _gateless_restore_pod(
        containerStatuses=[{"name": "app", "containerID": "containerd://x", "state": {"running": {}}}]
    )
    assert not worker.stage(running, source)
    status = kube.patches[-1][K.ANN_RESTORE_STATUS]
    assert (
        status.startswith(K.RESTORE_FAILED_PREFIX) and "started before this node's agent took up the restore" in status
    )


def test_a_restore_pod_with_another_init_container_and_no_gate_is_refused_as_not_a_restore_pod(tmp_path: Path) -> None:
    """Only native sidecars, held like the app containers, may come with a gateless restore pod: an init
    container would run the tenant's code in the volumes before the agent writes them."""
    from kubectl_snapshot.core import kubenames as K
    from shim.controller.podinfo import held_restore

    worker, kube = _worker(tmp_path)
    pod = _gateless_restore_pod()
    assert held_restore(pod)
    pod["spec"]["initContainers"] = [{"name": "proxy", "restartPolicy": "Always"}]
    assert held_restore(pod)  # a native sidecar: held at its create too
    pod["spec"]["initContainers"] = [{"name": "setup"}]
    assert not held_restore(pod)
    assert not worker.stage(pod, lambda p: (_ for _ in ()).throw(AssertionError("not read")))
    assert "is not a restore pod: its first init container must be the project's gate" in str(kube.patches[-1])
    # its containers, held at their create (the restore annotation), hear why at once, not after a timeout
    why = wait_pod_staged(worker.paths, UID, "app", expected=True, timeout_s=1)
    assert why is not None and "is not a restore pod" in why
    pod["spec"]["initContainers"] = []
    pod["spec"]["volumes"] = [{"name": K.GATE_VOLUME, "emptyDir": {}}]  # the gate's volume without the gate
    assert not held_restore(pod)
