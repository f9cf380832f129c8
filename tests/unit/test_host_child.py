"""The agent's children that join the host's mount namespace (shim/host/mounts.py, run_child)."""

from __future__ import annotations

import os
from typing import Any

from shim.host import mounts


def test_a_child_whose_host_process_ended_meanwhile_runs_again_with_a_live_one(monkeypatch: Any) -> None:
    # the node's containerd (the host process where PID 1 is out of reach) restarted by the install
    # between the lookup and the child's setns: looked up again, and the child runs once more
    gone = 999_999_999
    calls: list[int | None] = []

    def child(module: str, args: list[str], host_pid: int | None, timeout: float) -> dict[str, Any] | str:
        calls.append(host_pid)
        if host_pid == gone:
            return {"state": "failed", "detail": f"[Errno 2] No such file or directory: '/proc/{gone}/ns/mnt'"}
        return {"state": "mounted"}

    monkeypatch.setattr(mounts, "_run_child", child)
    assert mounts.run_child("m", [], gone, 1, rescan=os.getpid) == {"state": "mounted"}
    assert calls == [gone, os.getpid()]
    # the legitimate cases run once: an answer about anything else, a host process that still lives,
    # and a caller that gave no way to look again
    calls.clear()
    assert mounts.run_child("m", [], os.getpid(), 1, rescan=os.getpid) == {"state": "mounted"}

    def denied(module: str, args: list[str], host_pid: int | None, timeout: float) -> str:
        calls.append(host_pid)
        return "permission denied"

    monkeypatch.setattr(mounts, "_run_child", denied)
    assert mounts.run_child("m", [], gone, 1, rescan=os.getpid) == "permission denied"
    monkeypatch.setattr(mounts, "_run_child", child)
    assert mounts.run_child("m", [], gone, 1)["state"] == "failed"  # type: ignore[index]
    assert calls == [os.getpid(), gone, gone]
