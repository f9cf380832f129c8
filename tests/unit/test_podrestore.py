"""The rules of a whole-pod restore (shim.net.podrestore) over a recording command runner and a fake clock.

The real network lock in a real namespace is tested in tests/integration/test_whole_pod_wrapper.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.net.podrestore import GRACE_S, PodRestore, netns_of, with_prefix


class Recorder:
    """A PodNetwork that records its calls (the real one: tests/integration/test_whole_pod_wrapper.py)."""

    def __init__(self, error: OSError | None = None, local: tuple[str, ...] = ()) -> None:
        self.error = error
        self.local = set(local)
        self.calls: list[tuple[str, ...]] = []

    def lock(self, netns_path: str) -> None:
        self.calls.append(("lock", netns_path))
        if self.error:
            raise self.error

    def borrow(self, netns_path: str, addresses: list[str], added: list[str]) -> None:
        self.calls.append(("borrow", netns_path, *addresses))
        for a in addresses:
            if self.error:
                raise self.error
            if a not in self.local:
                self.local.add(a)
                added.append(with_prefix(a))

    def release(self, netns_path: str, borrowed: list[str]) -> list[str]:
        self.calls.append(("release", netns_path, *borrowed))
        return [str(self.error)] if self.error else []


def test_refusal_rules(tmp_path: Path) -> None:
    now = [1000.0]
    pod = PodRestore(str(tmp_path / "pod"), net=Recorder(), clock=lambda: now[0])
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
    pod = PodRestore(str(tmp_path / "pod"), net=Recorder())
    pod.record(["app", "cache"])
    assert pod.refusal("app", has_staged=False) is not None
    assert "app" in (pod.failed() or "")


def test_lock_is_taken_once_and_released_once(tmp_path: Path) -> None:
    rec = Recorder()
    pod = PodRestore(str(tmp_path / "pod"), net=rec)
    pod.record(["a", "b"])
    pod.lock("/var/run/netns/cni-1")
    pod.lock("/var/run/netns/cni-1")
    assert rec.calls == [("lock", "/var/run/netns/cni-1")]
    assert pod.release() is None
    assert rec.calls[1] == ("release", "/var/run/netns/cni-1")
    pod.lock("/var/run/netns/cni-1")  # released: never locked again
    assert len(rec.calls) == 2


def test_a_failing_lock_raises_and_records_nothing(tmp_path: Path) -> None:
    pod = PodRestore(str(tmp_path / "pod"), net=Recorder(error=OSError(93, "nf_tables: Protocol not supported")))
    pod.record(["a"])
    with pytest.raises(OSError, match="locking the pod's network failed"):
        pod.lock("/proc/1/ns/net")
    assert pod.release() is None  # nothing was locked: nothing to undo


def test_netns_of() -> None:
    spec: dict[str, object] = {
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network", "path": "/var/run/netns/x"}]}
    }
    assert netns_of(spec) == "/var/run/netns/x"
    assert netns_of({"linux": {"namespaces": [{"type": "network"}]}}) is None
    assert netns_of({}) is None


def test_old_addresses_are_borrowed_while_locked_and_given_back_at_release(tmp_path: Path) -> None:
    rec = Recorder(local=("10.244.1.7",))
    pod = PodRestore(str(tmp_path / "pod"), net=rec)
    pod.record(["a", "b"])
    pod.lock("/var/run/netns/cni-1")
    pod.borrow("/var/run/netns/cni-1", [])  # nothing to lend: no call
    assert len(rec.calls) == 1
    pod.borrow("/var/run/netns/cni-1", ["10.244.0.3"])
    pod.borrow("/var/run/netns/cni-1", ["fd00::3", "10.244.1.7"])  # the second one is local already
    assert pod.borrowed() == ["10.244.0.3/32", "fd00::3/128"]
    assert pod.release() is None
    assert rec.calls[-1] == ("release", "/var/run/netns/cni-1", "10.244.0.3/32", "fd00::3/128")
    assert pod.borrowed() == []


def test_a_failed_release_is_a_warning_and_the_pod_counts_as_released(tmp_path: Path) -> None:
    rec = Recorder()
    pod = PodRestore(str(tmp_path / "pod"), net=rec)
    pod.record(["a"])
    pod.lock("/var/run/netns/cni-1")
    rec.error = OSError(2, "gone")
    assert "gone" in (pod.release() or "")
    assert (tmp_path / "pod" / ".released").exists()


def test_a_failing_borrow_raises_with_the_addresses(tmp_path: Path) -> None:
    pod = PodRestore(str(tmp_path / "pod"), net=Recorder(error=OSError(17, "rtnetlink: File exists")))
    pod.record(["a"])
    with pytest.raises(OSError, match=r"old pod addresses 10\.244\.0\.3"):
        pod.borrow("/proc/1/ns/net", ["10.244.0.3"])
