"""The hook's choice to start `runc restore` before the page files are in place (two-phase staging
gate, shim/engine/staging.py): only with the node bundle's launcher as runc's CRIU, relaying to the CRIU
runc would have run, and never where CRIU would read a page file while it restores the namespaces (SysV
shared memory). The relay is tested in launcher/criurelay_test.go, the restore for real in
tests/integration/test_node_bundle.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kubectl_snapshot.core import constants as C
from shim import runtime_wrapper as W
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
    return exe


@pytest.fixture
def criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    exe = tmp_path / "bundle" / "criu"
    exe.parent.mkdir()
    exe.write_text("#!/bin/true\n")
    exe.chmod(0o755)
    monkeypatch.setenv("KUBECTL_SNAPSHOT_CRIU", str(exe))
    return exe


def _pending(tmp_path: Path) -> PendingPages:
    return PendingPages(str(tmp_path / "gates" / "c1.pages"), time.time() + 30)


def test_runc_gets_the_launcher_as_its_criu_relaying_to_the_installed_one(
    tmp_path: Path, staged: Path, launcher: Path, criu: Path
) -> None:
    pending = _pending(tmp_path)
    env = W.early_restore_env(str(staged), pending, ["--root", "/run/runc"])
    assert env is not None
    assert env[W.RELAY_CRIU_ENV] == str(criu)
    assert env[W.PAGES_GATE_ENV] == pending.gate
    assert abs(float(env[W.PAGES_DEADLINE_ENV]) - pending.deadline) < 0.01
    assert env["PATH"] == os.environ["PATH"]  # runc gets the hook's environment besides
    create = W.CreateArgs("c1", str(tmp_path / "bundle"), None, None, [])
    inv = W.Invocation(["--root", "/run/runc", "--criu", "/usr/sbin/criu"], "create", [])
    cmd = W.restore_command("/usr/sbin/runc", inv, create, str(staged), env[W.LAUNCHER_ENV])
    assert cmd[:6] == ["/usr/sbin/runc", "--criu", str(launcher), "--root", "/run/runc", "restore"]
    assert cmd.count("--criu") == 1


def test_the_relay_runs_the_criu_runc_would_run(
    tmp_path: Path, staged: Path, launcher: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBECTL_SNAPSHOT_CRIU", raising=False)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "criu").write_text("#!/bin/true\n")
    (bindir / "criu").chmod(0o755)
    own = tmp_path / "own-criu"
    own.write_text("#!/bin/true\n")
    own.chmod(0o755)
    monkeypatch.setenv("PATH", f"relative:{bindir}")
    pending = _pending(tmp_path)
    assert (W.early_restore_env(str(staged), pending) or {})[W.RELAY_CRIU_ENV] == str(bindir / "criu")
    assert (W.early_restore_env(str(staged), pending, [f"--criu={own}"]) or {})[W.RELAY_CRIU_ENV] == str(own)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert W.early_restore_env(str(staged), pending) is None  # no CRIU to relay to: the hook waits itself


@pytest.mark.parametrize("case", ["no launcher", "relative launcher", "launcher not executable", "SysV shm"])
def test_the_hook_waits_for_the_pages_itself(
    tmp_path: Path, staged: Path, launcher: Path, criu: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    if case == "no launcher":
        monkeypatch.delenv(W.LAUNCHER_ENV)
    elif case == "relative launcher":
        monkeypatch.setenv(W.LAUNCHER_ENV, "kubectl-snapshot-runc")
    elif case == "launcher not executable":
        launcher.chmod(0o644)
    else:  # CRIU fills SysV shared memory from the page files while it restores the IPC namespace
        (staged / C.CHECKPOINT_DIRECTORY / "ipcns-shm-11.img").write_bytes(b"x")
    assert W.early_restore_env(str(staged), _pending(tmp_path)) is None


def test_the_pages_still_to_come_go_to_criu_and_those_in_already_do_not(
    tmp_path: Path, staged: Path, launcher: Path, criu: Path
) -> None:
    """restore_env: CRIU waits at the relay only for page files the agent has not answered yet;
    answered ones cost no relay, and a failure is a refusal."""
    paths = StatePaths(str(tmp_path / "state"))
    assert W.restore_env(str(staged), None) == (None, None)  # one phase: the pages are in
    with images_announced(paths) as (gate, pending):
        assert not pending.settled()
        env, why = W.restore_env(str(staged), pending)
        assert why is None and env is not None and env[W.PAGES_GATE_ENV] == pending.gate
        gate.answer(READY)
        assert pending.settled()
        assert W.restore_env(str(staged), pending) == (None, None)
    with images_announced(paths) as (gate, pending):
        gate.answer(FAILED, "a chunk did not match its digest")
        env, why = W.restore_env(str(staged), pending)
        assert env is None and why is not None and "a chunk did not match its digest" in why
    # the agent gone before it answered: settled, and refused
    assert W.restore_env(str(staged), pending)[1] is not None
