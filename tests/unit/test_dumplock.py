"""The dump-time network lock (shim.dumplock) over a recording runner: which namespaces, in which order.

Its effect on real traffic is the pod lock's (tests/integration/test_whole_pod_wrapper.py); a real
group dump under it is tests/integration/test_whole_pod_restore.py."""

from __future__ import annotations

import pytest

from kubectl_snapshot.core.errors import FailedPrecondition
from shim import dumplock

NS = {1: "net:[1]", 100: "net:[7]", 101: "net:[7]", 200: "net:[8]", 300: "net:[9]", 301: "net:[9]"}


@pytest.fixture(autouse=True)
def namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dumplock, "_netns", lambda pid: NS.get(pid) if pid != "self" else "net:[9]")
    monkeypatch.setattr(dumplock, "host_pid", lambda: None)


def test_only_namespaces_shared_by_two_containers_are_locked_never_the_agents() -> None:
    assert dumplock.shared_namespaces([100, 101, 200], ["net:[1]"]) == {"net:[7]": 100}
    assert dumplock.shared_namespaces([300, 301], ["net:[9]"]) == {}  # the agent's (host network) own


def test_locked_for_the_block_then_unlocked() -> None:
    calls: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str]:
        calls.append(argv)
        return 0, ""

    with dumplock.pod_network_locked([100, 101, 200], run=run):
        assert len(calls) == 1 and calls[0][:2] == ["nsenter", "--net=/proc/100/ns/net"]
        assert dumplock.LOCK_CHAIN in calls[0][-1] and "-j DROP" in calls[0][-1]
    assert len(calls) == 2 and "-X " + dumplock.LOCK_CHAIN in calls[1][-1]


def test_a_lock_that_cannot_be_taken_fails_the_dump_with_a_hint() -> None:
    with (
        pytest.raises(FailedPrecondition, match="locking the pod's network for the dump failed") as e,
        dumplock.pod_network_locked([100, 101], run=lambda argv: (127, "nsenter: not found")),
    ):
        pass
    assert "iptables-restore" in (e.value.hint or "")


def test_a_lock_left_by_a_killed_agent_is_lifted_where_it_is() -> None:
    calls: list[list[str]] = []

    def run(argv: list[str]) -> tuple[int, str]:
        calls.append(argv)
        return 0, ""

    assert dumplock.release_leftover([100, 101, 200], run=run) == 1
    assert len(calls) == 1 and "iptables -S " + dumplock.LOCK_CHAIN in calls[0][-1]
    assert dumplock.release_leftover([100, 101], run=lambda argv: (3, "")) == 0  # no chain there
