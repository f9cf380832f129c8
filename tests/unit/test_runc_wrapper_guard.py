"""The runtime wrapper itself (a real subprocess, as containerd's shim runs it) refuses edited images.

Only the final `runc restore` is replaced by a recording script here; the round trips with the real
runc and CRIU are tests/integration/test_agent_roundtrip.py. The reason reaches the shim through
runc's --log file (JSON, level error), which containerd turns into the CreateContainerError message
that the kubelet puts into the pod's Events and status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pycriu")

from tests.unit.test_criu_guard import ALL, bundle, creds, make_images

REPO = Path(__file__).resolve().parents[2]


def run_create(
    tmp_path: Path, spec: dict[str, object], *, plant: str | None = None, **image_kw: object
) -> tuple[int, str, Path]:
    """The wrapper's create of a staged restore; `plant`: a restore.log symlink to it in the staged dir.
    The fake runc records its arguments and, as CRIU does, appends to restore.log in its --work-path."""
    state = tmp_path / "state"
    cid = "c1"
    make_images(state / "staged" / "by-id" / cid / "checkpoint", **image_kw)  # type: ignore[arg-type]
    if plant is not None:
        (state / "staged" / "by-id" / cid / "restore.log").symlink_to(plant)
    b = tmp_path / "bundle"
    (b / "rootfs").mkdir(parents=True)
    (b / "config.json").write_text(json.dumps(spec))
    ran = tmp_path / "runc-ran"
    fake = tmp_path / "runc"
    fake.write_text(
        f'#!/bin/sh\necho "$@" > {ran}\n'
        'while [ $# -gt 0 ]; do [ "$1" = --work-path ] && echo criu-log >> "$2/restore.log"; shift; done\n'
    )
    fake.chmod(0o755)
    log = tmp_path / "runc.log"
    env = {**os.environ, "KUBECTL_SNAPSHOT_STATE_DIR": str(state), "KUBECTL_SNAPSHOT_RUNC": str(fake)}
    proc = subprocess.run(
        [sys.executable, "-m", "shim.runtime_wrapper", "--log", str(log), "create", "--bundle", str(b), cid],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, log.read_text() if log.exists() else "", ran


def test_matching_images_go_on_to_runc_restore(tmp_path: Path) -> None:
    rc, log, ran = run_create(tmp_path, bundle())
    assert rc == 0, log
    args = ran.read_text().split()
    assert args[:3] == ["--log", str(tmp_path / "runc.log"), "restore"], args


def test_the_used_staged_dir_is_gone_at_once_and_deleted_in_the_background(tmp_path: Path) -> None:
    """After the restore the staged dir is no longer there under its name when create returns (a re-create
    starts afresh); its files are deleted by a detached process that keeps none of the hook's output
    open (run_create reads the hook's output to its end), and nothing is left in the end."""
    rc, log, _ = run_create(tmp_path, bundle())
    assert rc == 0, log
    by_id = tmp_path / "state" / "staged" / "by-id"
    assert not (by_id / "c1").exists()
    deadline = time.monotonic() + 10
    while os.listdir(by_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(by_id) == []


def test_a_staged_dir_that_cannot_be_renamed_is_removed_in_place(tmp_path: Path) -> None:
    from shim.runtime_wrapper import remove_detached

    staged = tmp_path / "c1"
    (staged / "checkpoint").mkdir(parents=True)
    (staged / "checkpoint" / "pages-1.img").write_bytes(b"x" * 8192)
    (tmp_path / f".removing-c1-{os.getpid()}").mkdir()  # the trash name is taken: rename fails
    (tmp_path / f".removing-c1-{os.getpid()}" / "other").write_bytes(b"")
    remove_detached(str(staged))
    assert not staged.exists()


def test_a_planted_restore_log_receives_nothing(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"kept")
    rc, log, ran = run_create(tmp_path, bundle(), plant=str(victim))
    assert rc == 0, log
    assert ran.exists() and victim.read_bytes() == b"kept"


def test_edited_capabilities_stop_the_restore_with_the_reason_in_runcs_log(tmp_path: Path) -> None:
    every = [c for c in ALL if c != "CAP_SYS_RESOURCE"]
    rc, log, ran = run_create(tmp_path, bundle(caps=[]), creds_by_tid={1: creds(caps=every)})
    assert rc == 1
    assert not ran.exists()  # runc restore never ran
    entry = json.loads(log.splitlines()[-1])
    assert entry["level"] == "error"
    assert "refusing to restore" in entry["msg"] and "CAP_SYS_ADMIN" in entry["msg"] and "hint:" in entry["msg"]
    # the staged data stays for inspection; nothing was restored
    assert (tmp_path / "state" / "staged" / "by-id" / "c1" / "checkpoint" / "core-1.img").exists()
