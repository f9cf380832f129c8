"""The dump-time network lock (shim.net.dumplock) over a recording lock: which namespaces, in which order.

Its effect on real traffic, with the real nf_tables lock, is tests/integration/test_netlink_tools.py
and the pod lock's (tests/integration/test_whole_pod_wrapper.py); a real group dump under it is
tests/integration/test_whole_pod_restore.py."""

from __future__ import annotations

import os

import pytest

from kubectl_snapshot.core.errors import FailedPrecondition
from shim.net import dumplock

NS = {1: "net:[1]", 100: "net:[7]", 101: "net:[7]", 200: "net:[8]", 300: "net:[9]", 301: "net:[9]"}


@pytest.fixture(autouse=True)
def namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dumplock, "_netns", lambda pid: NS.get(pid) if pid != "self" else "net:[9]")
    monkeypatch.setattr(dumplock, "host_pid", lambda: None)


@pytest.fixture(autouse=True)
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """os.open of /proc/PID/ns/net as fd 1000 + PID (the namespace is held open while locked)."""
    paths: list[str] = []

    def fake_open(path: str, flags: int) -> int:
        paths.append(path)
        return 1000 + int(path.split("/")[2])

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "close", lambda fd: None)
    return paths


class Recorder:
    def __init__(self, error: OSError | None = None, existed: bool = True) -> None:
        self.calls: list[tuple[str, str]] = []
        self.error, self.existed = error, existed

    def lock(self, netns_path: str) -> None:
        self.calls.append(("lock", netns_path))
        if self.error:
            raise self.error

    def unlock(self, netns_path: str) -> bool:
        self.calls.append(("unlock", netns_path))
        return self.existed


def test_only_namespaces_shared_by_two_containers_are_locked_never_the_agents() -> None:
    assert dumplock.shared_namespaces([100, 101, 200], ["net:[1]"]) == {"net:[7]": 100}
    assert dumplock.shared_namespaces([300, 301], ["net:[9]"]) == {}  # the agent's (host network) own


def test_locked_for_the_block_then_unlocked_through_the_held_namespace(opened: list[str]) -> None:
    rec = Recorder()
    with dumplock.pod_network_locked([100, 101, 200], net=rec):
        assert opened == ["/proc/100/ns/net"]
        assert rec.calls == [("lock", "/proc/self/fd/1100")]
    # unlocked through the namespace held open: the dumped tasks (and their /proc/PID) may be gone
    assert rec.calls == [("lock", "/proc/self/fd/1100"), ("unlock", "/proc/self/fd/1100")]


def test_a_lock_that_cannot_be_taken_fails_the_dump_with_a_hint() -> None:
    rec = Recorder(error=OSError(93, "nf_tables: Protocol not supported"))
    with (
        pytest.raises(FailedPrecondition, match="locking the pod's network for the dump failed") as e,
        dumplock.pod_network_locked([100, 101], net=rec),
    ):
        pass
    assert "nf_tables" in (e.value.hint or "")
    assert rec.calls == [("lock", "/proc/self/fd/1100")]  # nothing to undo


def test_a_lock_left_by_a_killed_agent_is_lifted_where_it_is() -> None:
    rec = Recorder()
    assert dumplock.release_leftover([100, 101, 200], net=rec) == 1
    assert rec.calls == [("unlock", "/proc/100/ns/net")]
    assert dumplock.release_leftover([100, 101], net=Recorder(existed=False)) == 0  # no table there
