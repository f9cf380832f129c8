"""The rules of a whole-pod restore (shim.podrestore) over a recording command runner and a fake clock.

The real network lock in a real namespace is tested in tests/integration/test_whole_pod_wrapper.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.podrestore import GRACE_S, LOCK_CHAIN, PodRestore, borrow_script, lock_script, netns_of, unlock_script


class Recorder:
    def __init__(self, rc: int = 0) -> None:
        self.rc = rc
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], stdin: str) -> tuple[int, str]:
        self.calls.append(argv)
        return self.rc, "iptables-restore: nope" if self.rc else ""


def test_refusal_rules(tmp_path: Path) -> None:
    now = [1000.0]
    pod = PodRestore(str(tmp_path / "pod"), run=Recorder(), clock=lambda: now[0])
    assert pod.refusal("app", has_staged=True) is None  # not a restored pod at all
    pod.record(["app", "cache"])
    assert pod.refusal("sidecar", has_staged=False) is None  # not in the snapshot: created as usual
    assert pod.refusal("app", has_staged=True) is None
    pod.lock("/proc/1/ns/net")
    pod.release()
    now[0] += GRACE_S + 1
    assert pod.refusal("app", has_staged=False) is None  # restored long ago: an ordinary restart
    now[0] -= GRACE_S
    why = pod.refusal("app", has_staged=False)
    assert why is not None and "stopped right after it was restored" in why
    assert pod.failed() is not None
    why = pod.refusal("cache", has_staged=True)  # even with staged data: the pod has failed
    assert why is not None and "not started from scratch" in why


def test_before_release_a_recreate_without_staged_data_fails_the_pod(tmp_path: Path) -> None:
    pod = PodRestore(str(tmp_path / "pod"), run=Recorder())
    pod.record(["app", "cache"])
    assert pod.refusal("app", has_staged=False) is not None
    assert "app" in (pod.failed() or "")


def test_lock_is_taken_once_and_released_once(tmp_path: Path) -> None:
    rec = Recorder()
    pod = PodRestore(str(tmp_path / "pod"), run=rec)
    pod.record(["a", "b"])
    pod.lock("/var/run/netns/cni-1")
    pod.lock("/var/run/netns/cni-1")
    assert len(rec.calls) == 1 and rec.calls[0][:2] == ["nsenter", "--net=/var/run/netns/cni-1"]
    assert pod.release() is None
    assert len(rec.calls) == 2 and "ss -K" in rec.calls[1][-1]
    pod.lock("/var/run/netns/cni-1")  # released: never locked again
    assert len(rec.calls) == 2


def test_a_failing_lock_raises_and_records_nothing(tmp_path: Path) -> None:
    pod = PodRestore(str(tmp_path / "pod"), run=Recorder(rc=1))
    pod.record(["a"])
    with pytest.raises(OSError, match="locking the pod's network failed"):
        pod.lock("/proc/1/ns/net")
    assert pod.release() is None  # nothing was locked: nothing to undo


def test_scripts_and_netns() -> None:
    assert LOCK_CHAIN in lock_script() and "ip_nonlocal_bind" in lock_script()
    assert unlock_script().index("ss -K") < unlock_script().index("iptables-restore")  # abort while locked
    spec: dict[str, object] = {
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/var/run/netns/x"}]}
    }
    assert netns_of(spec) == "/var/run/netns/x"
    assert netns_of({"linux": {"namespaces": [{"type": "network"}]}}) is None
    assert netns_of({}) is None


class Borrower(Recorder):
    """Answers the borrow script with the addresses it was asked to add (as if none was local yet)."""

    def __call__(self, argv: list[str], stdin: str) -> tuple[int, str]:
        self.calls.append(argv)
        script = argv[-1]
        added = [w for w in script.split() if w.endswith(("/32", "/128"))]
        return self.rc, "\n".join(dict.fromkeys(added)) if "ip addr add" in script else ""


def test_old_addresses_are_borrowed_while_locked_and_given_back_after_the_abort(tmp_path: Path) -> None:
    rec = Borrower()
    pod = PodRestore(str(tmp_path / "pod"), run=rec)
    pod.record(["a", "b"])
    pod.lock("/var/run/netns/cni-1")
    pod.borrow("/var/run/netns/cni-1", [])  # nothing to lend: no command
    assert len(rec.calls) == 1
    pod.borrow("/var/run/netns/cni-1", ["10.244.0.3"])
    pod.borrow("/var/run/netns/cni-1", ["fd00::3"])
    assert pod.borrowed() == ["10.244.0.3/32", "fd00::3/128"]
    assert "ip addr add 10.244.0.3/32 dev lo" in rec.calls[1][-1] and "nodad" in rec.calls[2][-1]
    assert pod.release() is None
    unlock = rec.calls[-1][-1]
    # connections from the old address are aborted before it goes away, both before the lock is lifted
    assert unlock.index("ss -K") < unlock.index("ip addr del 10.244.0.3/32 dev lo") < unlock.index("iptables-restore")
    assert "ip addr del fd00::3/128 dev lo" in unlock
    assert pod.borrowed() == []


def test_an_address_already_local_is_not_borrowed_or_removed() -> None:
    script = borrow_script(["10.244.1.7"])
    assert "ip -o addr show to 10.244.1.7/32" in script and script.index("show to") < script.index("addr add")
    assert "ip addr del" not in unlock_script([])


def test_a_failing_borrow_raises_with_the_addresses(tmp_path: Path) -> None:
    pod = PodRestore(str(tmp_path / "pod"), run=Recorder(rc=2))
    pod.record(["a"])
    with pytest.raises(OSError, match=r"old pod addresses 10\.244\.0\.3"):
        pod.borrow("/proc/1/ns/net", ["10.244.0.3"])
