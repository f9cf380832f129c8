"""The hook's choice to start `runc restore` before the page files are in place (two-phase staging
gate, shim/engine/staging.py): only with the node bundle's launcher as CRIU's action script, never
where CRIU would read a page file while it restores the namespaces (SysV shared memory), and never
over an operator's own CRIU_CONFIG_FILE. The restore itself is tested for real in
tests/integration/test_node_bundle.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kubectl_snapshot.core import constants as C
from shim import runc_wrapper as W
from shim.engine.staging import FAILED, READY, PendingPages, StatePaths
from tests.unit.test_staging_gate import images_announced


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    d = tmp_path / "state" / "staged" / "c1"
    (d / C.CHECKPOINT_DIRECTORY).mkdir(parents=True)
    (d / C.CHECKPOINT_DIRECTORY / "core-1.img").write_bytes(b"x")
    return d


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "kubectl-snapshot-runc"
    exe.write_text("#!/bin/true\n")
    exe.chmod(0o755)
    monkeypatch.setenv(W.LAUNCHER_ENV, str(exe))
    monkeypatch.delenv(W.CRIU_CONFIG_ENV, raising=False)
    return exe


def _pending(tmp_path: Path) -> PendingPages:
    return PendingPages(str(tmp_path / "gates" / "c1.pages"), time.time() + 30)


def test_criu_gets_the_launcher_as_its_action_script(tmp_path: Path, staged: Path, launcher: Path) -> None:
    paths = StatePaths(str(tmp_path / "state"))
    pending = _pending(tmp_path)
    env = W.early_restore_env(paths, str(staged), pending)
    assert env is not None
    assert Path(env[W.CRIU_CONFIG_ENV]).read_text() == f"action-script {launcher}\n"
    assert Path(env[W.CRIU_CONFIG_ENV]).parent == Path(paths.root)  # the agent's state dir, not the staged layer
    assert env[W.PAGES_GATE_ENV] == pending.gate
    assert abs(float(env[W.PAGES_DEADLINE_ENV]) - pending.deadline) < 0.01
    assert env["PATH"] == os.environ["PATH"]  # runc gets the hook's environment besides
    # a second restore with the same launcher reuses the file; another launcher rewrites it
    assert W.early_restore_env(paths, str(staged), pending) == env
    other = tmp_path / "other-launcher"
    other.write_text("#!/bin/true\n")
    other.chmod(0o755)
    os.environ[W.LAUNCHER_ENV] = str(other)
    env2 = W.early_restore_env(paths, str(staged), pending)
    assert env2 is not None and Path(env2[W.CRIU_CONFIG_ENV]).read_text() == f"action-script {other}\n"


def test_a_planted_config_name_in_the_staged_layer_is_not_written_through(
    tmp_path: Path, staged: Path, launcher: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (staged / "criu-early-restore.conf").symlink_to(victim)  # the layer is the tenant's
    env = W.early_restore_env(StatePaths(str(tmp_path / "state")), str(staged), _pending(tmp_path))
    assert env is not None and victim.read_text() == "keep"


@pytest.mark.parametrize(
    "case",
    ["no launcher", "relative launcher", "launcher not executable", "operator's CRIU_CONFIG_FILE", "SysV shm"],
)
def test_the_hook_waits_for_the_pages_itself(
    tmp_path: Path, staged: Path, launcher: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    if case == "no launcher":
        monkeypatch.delenv(W.LAUNCHER_ENV)
    elif case == "relative launcher":
        monkeypatch.setenv(W.LAUNCHER_ENV, "kubectl-snapshot-runc")
    elif case == "launcher not executable":
        launcher.chmod(0o644)
    elif case == "operator's CRIU_CONFIG_FILE":
        monkeypatch.setenv(W.CRIU_CONFIG_ENV, "/etc/criu/mine.conf")
    else:  # CRIU fills SysV shared memory from the page files while it restores the IPC namespace
        (staged / C.CHECKPOINT_DIRECTORY / "ipcns-shm-11.img").write_bytes(b"x")
    assert W.early_restore_env(StatePaths(str(tmp_path / "state")), str(staged), _pending(tmp_path)) is None


def test_the_pages_still_to_come_go_to_criu_and_those_in_already_do_not(
    tmp_path: Path, staged: Path, launcher: Path
) -> None:
    """restore_env: CRIU waits at its action script only for page files the agent has not answered yet;
    answered ones cost no action script (a process start per CRIU action), and a failure is a refusal."""
    paths = StatePaths(str(tmp_path / "state"))
    assert W.restore_env(paths, str(staged), None) == (None, None)  # one phase: the pages are in
    with images_announced(paths) as (gate, pending):
        assert not pending.settled()
        env, why = W.restore_env(paths, str(staged), pending)
        assert why is None and env is not None and env[W.PAGES_GATE_ENV] == pending.gate
        gate.answer(READY)
        assert pending.settled()
        assert W.restore_env(paths, str(staged), pending) == (None, None)
    with images_announced(paths) as (gate, pending):
        gate.answer(FAILED, "a chunk did not match its digest")
        env, why = W.restore_env(paths, str(staged), pending)
        assert env is None and why is not None and "a chunk did not match its digest" in why
    # the agent gone before it answered: settled, and refused
    assert W.restore_env(paths, str(staged), pending)[1] is not None
