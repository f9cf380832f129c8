"""hostfacts.host_pid_once: the freeze guard's four cgroup look-ups per freeze scan /proc once."""

from __future__ import annotations

import threading

import pytest

from shim.host import facts as hostfacts


def test_host_pid_is_looked_up_once_per_block_and_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def scan() -> int | None:
        calls.append(threading.current_thread().name)
        return 4242

    monkeypatch.setattr(hostfacts, "_host_pid", scan)
    with hostfacts.host_pid_once():
        assert [hostfacts.host_pid() for _ in range(4)] == [4242] * 4
        with hostfacts.host_pid_once():  # nested: still the outer block's answer
            assert hostfacts.host_pid() == 4242
        other = threading.Thread(target=hostfacts.host_pid, name="other")  # another thread looks for itself
        other.start()
        other.join()
    assert len(calls) == 2 and "other" in calls
    hostfacts.host_pid()
    hostfacts.host_pid()
    assert len(calls) == 4  # outside a block: every call looks again (containerd may have been restarted)
