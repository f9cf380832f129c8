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

from shim.engine.staging import FAILED, READY, StagingGate, StatePaths, wait_staged


def test_a_container_no_agent_gated_is_not_held(tmp_path: Path) -> None:
    assert wait_staged(StatePaths(str(tmp_path)), "plain") is None
    assert wait_staged(StatePaths(str(tmp_path)), "../not-a-key") is None  # not a key the agent gates


def test_the_hook_waits_for_ready(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths, "c1")
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
    gate = StagingGate(paths, "c1")
    gate.answer(FAILED, "DigestMismatch: blob sha256:ab did not match")
    why = wait_staged(paths, "c1")
    gate.close()
    assert why is not None and "staging of this restore failed" in why and "DigestMismatch" in why


def test_an_agent_that_let_go_without_answering_is_not_waited_for(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths, "c1")
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
    gate = StagingGate(paths, "c1")
    gate.answer(READY)
    os.close(gate._fd)
    assert wait_staged(paths, "c1") is None


def test_a_slow_staging_is_given_up_at_the_deadline(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    gate = StagingGate(paths, "c1")
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
    gate = StagingGate(paths, "c1")
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
    first = StagingGate(paths, "c1")
    try:
        with pytest.raises(OSError):
            StagingGate(paths, "c1")  # the agent then creates the containers after the download, as before
        first.answer(READY)
        assert wait_staged(paths, "c1") is None  # the second attempt removed nothing of the first's
    finally:
        first.close()
