"""The node's disk ledger (kubectl_snapshot/core/diskspace.py, shim/host/diskspace.py) over a fake statvfs.

The filesystem is a fake: `total` and `available` bytes (f_frsize 1), and a device number per path,
so that the arithmetic is checked exactly; the engine's tests (test_restore_limits.py,
test_checkpoint_orchestration.py) show that dumps and restores go through it.
"""

from __future__ import annotations

import os
import threading

import pytest
from prometheus_client import generate_latest

from kubectl_snapshot.core import nodesettings as NS
from kubectl_snapshot.core.diskspace import DUMP, STAGING, Ask, DiskPolicy, Threshold, parse_share, parse_threshold
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument
from shim.host.diskspace import DiskLedger
from shim.service.metrics import AgentMetrics

GIB = 1 << 30


class FakeFs:
    def __init__(self, total: int, available: int) -> None:
        self.total, self.available = total, available

    def statvfs(self, path: str) -> os.statvfs_result:
        return os.statvfs_result((4096, 1, self.total, self.available, self.available, 0, 0, 0, 0, 255))


def ledger(fs: FakeFs, policy: DiskPolicy | None = None, devices: dict[str, int] | None = None) -> DiskLedger:
    return DiskLedger(policy, statvfs=fs.statvfs, device_of=lambda p: (devices or {}).get(p, 1))


def ask(need: int, *, kind: str = STAGING, namespace: str = "a", keep: int = 0) -> Ask:
    return Ask(need=need, what="the test's write", hint="do something", kind=kind, namespace=namespace, keep=keep)


def test_thresholds_and_shares_parse_as_the_kubelet_writes_them() -> None:
    assert parse_threshold("10%") == Threshold(percent=10.0)
    assert parse_threshold("7.5%").of(1000) == 75
    assert parse_threshold("5Gi") == Threshold(percent=None, bytes=5 * GIB)
    assert parse_threshold("500M").of(10**12) == 500 * 10**6
    assert parse_threshold("1073741824").of(0) == GIB
    assert parse_share("50%") == 0.5 and parse_share("100%") == 1.0
    for bad in ("", "ten", "-1%", "100%", "5 GiB", "1e9"):
        with pytest.raises(InvalidArgument):
            parse_threshold(bad)
    for bad in ("0%", "150%", "0.5", ""):
        with pytest.raises(InvalidArgument):
            parse_share(bad)


def test_a_write_that_would_take_the_node_under_the_threshold_is_refused() -> None:
    d = ledger(FakeFs(total=100 * GIB, available=20 * GIB))  # 10 GiB kept free: 10 GiB room
    with d.reserve("/s", ask(10 * GIB, namespace="")) as r:
        assert r.room == 10 * GIB
    with pytest.raises(FailedPrecondition) as e:
        d.take("/s", ask(10 * GIB + 1, namespace=""))
    err = e.value
    assert err.retryable and err.hint == "do something"
    assert "not enough space" in err.message and "10.0 GiB is kept free" in err.message
    assert "the kubelet evicts pods below it" in err.message


def test_a_byte_threshold_and_the_callers_floor_count_the_larger() -> None:
    fs = FakeFs(total=100 * GIB, available=20 * GIB)
    d = ledger(fs, DiskPolicy(threshold=parse_threshold("2Gi"), namespace_share=1.0))
    assert d.take("/s", ask(18 * GIB)).room == 18 * GIB
    d = ledger(fs, DiskPolicy(threshold=parse_threshold("2Gi"), namespace_share=1.0))
    with pytest.raises(FailedPrecondition, match=r"15\.0 GiB is kept free"):
        d.take("/s", ask(6 * GIB, keep=15 * GIB))


def test_promises_in_flight_count_until_released_also_on_errors() -> None:
    d = ledger(FakeFs(total=100 * GIB, available=20 * GIB), DiskPolicy(namespace_share=1.0))
    first = d.take("/s", ask(6 * GIB))
    with pytest.raises(FailedPrecondition, match=r"6\.0 GiB is promised to snapshots and restores in flight"):
        d.take("/s", ask(6 * GIB, namespace="b"))
    assert d.take("/s", ask(4 * GIB, namespace="b")).room == 4 * GIB  # what is left, exactly
    first.release()
    first.release()  # idempotent: the second release takes nothing of the others'
    assert d.held() == {(STAGING, "b"): 4 * GIB}
    with pytest.raises(RuntimeError), d.reserve("/s", ask(6 * GIB)):
        raise RuntimeError("the write failed")
    assert d.held() == {(STAGING, "b"): 4 * GIB}  # the failed write's promise went


def test_other_filesystems_keep_their_own_books() -> None:
    d = ledger(FakeFs(total=100 * GIB, available=20 * GIB), devices={"/state": 1, "/other": 2})
    d.take("/state", ask(10 * GIB, kind=DUMP))
    d.take("/other", ask(5 * GIB, kind=DUMP))  # nothing promised there yet


def test_one_namespace_cannot_take_more_than_its_share_of_staging() -> None:
    d = ledger(FakeFs(total=100 * GIB, available=20 * GIB), DiskPolicy(namespace_share=0.5))  # 5 GiB each
    d.take("/s", ask(3 * GIB, namespace="busy"))
    with pytest.raises(FailedPrecondition) as e:
        d.take("/s", ask(3 * GIB, namespace="busy"))
    assert "namespace 'busy' may not stage more" in e.value.message and e.value.retryable
    assert "(50%, 5.0 GiB) of the 10.0 GiB the node has for staging" in e.value.message
    d.take("/s", ask(3 * GIB, namespace="quiet"))  # another tenant still gets its restore
    d.take("/s", ask(2 * GIB, kind=DUMP, namespace="busy"))  # a dump is no staging: the share is for restores
    assert d.held() == {(STAGING, "busy"): 3 * GIB, (STAGING, "quiet"): 3 * GIB, (DUMP, "busy"): 2 * GIB}


def test_concurrent_takers_never_overcommit() -> None:
    d = ledger(FakeFs(total=100 * GIB, available=20 * GIB), DiskPolicy(namespace_share=1.0))
    admitted: list[int] = []
    start = threading.Barrier(16)

    def one(i: int) -> None:
        start.wait()
        try:
            d.take("/s", ask(GIB, namespace=str(i)))
            admitted.append(i)
        except FailedPrecondition:
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 10  # 10 GiB of room, 1 GiB each


def test_configure_changes_the_policy_for_later_reservations() -> None:
    d = ledger(FakeFs(total=100 * GIB, available=20 * GIB))
    d.configure(DiskPolicy(threshold=parse_threshold("19Gi")))
    with pytest.raises(FailedPrecondition):
        d.take("/s", ask(2 * GIB))


def test_the_node_settings_carry_the_policy_and_refuse_bad_values() -> None:
    assert NS.NodeSettings().disk == DiskPolicy(Threshold(percent=10.0), 0.5)
    s = NS.NodeSettings(disk_eviction_threshold="5Gi", staging_namespace_share="100%")
    assert s.disk == DiskPolicy(Threshold(percent=None, bytes=5 * GIB), 1.0)
    assert NS.check_value("disk_eviction_threshold", "15%") == "15%"
    with pytest.raises(InvalidArgument, match="--disk-eviction-threshold: disk eviction threshold 'lots'"):
        NS.check_value("disk_eviction_threshold", "lots", "--disk-eviction-threshold")
    with pytest.raises(InvalidArgument, match="staging namespace share"):
        NS.check_value("staging_namespace_share", "2")
    assert "disk_eviction_threshold" in NS.PER_NODE_KEYS  # disks and kubelet configurations differ per node


def test_the_metrics_show_what_the_ledger_holds() -> None:
    d = ledger(FakeFs(total=100 * GIB, available=20 * GIB))
    m = AgentMetrics()
    m.track_disk(d.held)
    r = d.take("/s", ask(GIB, namespace="a"))
    text = generate_latest(m.registry).decode()
    assert 'kubectl_snapshot_disk_reserved_bytes{kind="staging",namespace="a"} 1.073741824e+09' in text
    r.release()
    assert 'kubectl_snapshot_disk_reserved_bytes{kind="staging"' not in generate_latest(m.registry).decode()
