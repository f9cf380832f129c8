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
        [sys.executable, "-m", "shim.runc_wrapper", "--log", str(log), "create", "--bundle", str(b), cid],
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
