"""The direct cgroup freezer: where a task's freezer is, and the file protocol (v1 and v2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.host.freezer import CgroupFreezer, cgroupfs_root, parse_proc_cgroup

V1 = "12:pids:/kst/w\n5:freezer:/kst/w\n1:name=systemd:/kst/w\n0::/kst/w\n"
V2 = "0::/kubepods.slice/pod-x/cri-containerd-abc.scope\n"


def test_parse_prefers_the_v1_freezer_over_the_unified_line() -> None:
    assert parse_proc_cgroup(V1) == ("/kst/w", False)
    assert parse_proc_cgroup(V2) == ("/kubepods.slice/pod-x/cri-containerd-abc.scope", True)
    assert parse_proc_cgroup("3:cpu,cpuacct:/x\n") is None
    assert parse_proc_cgroup("") is None


def test_cgroupfs_is_reached_through_the_host_root_from_a_container() -> None:
    assert cgroupfs_root(None) == "/sys/fs/cgroup"
    assert cgroupfs_root(4242) == "/proc/4242/root/sys/fs/cgroup"


def test_v1_protocol(tmp_path: Path) -> None:
    (tmp_path / "freezer.state").write_text("THAWED\n")
    fz = CgroupFreezer(str(tmp_path), v2=False)
    assert not fz.frozen()
    fz.freeze(timeout=1)
    assert (tmp_path / "freezer.state").read_text() == "FROZEN" and fz.frozen()
    fz.thaw()
    assert (tmp_path / "freezer.state").read_text() == "THAWED"


def test_v2_protocol_waits_for_the_kernel(tmp_path: Path) -> None:
    (tmp_path / "cgroup.freeze").write_text("0\n")
    (tmp_path / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    fz = CgroupFreezer(str(tmp_path), v2=True)
    fz.freeze(timeout=1)
    assert (tmp_path / "cgroup.freeze").read_text() == "1"
    fz.thaw()
    assert (tmp_path / "cgroup.freeze").read_text() == "0"


def test_a_cgroup_that_never_freezes_is_thawed_and_reported(tmp_path: Path) -> None:
    (tmp_path / "cgroup.freeze").write_text("0\n")
    (tmp_path / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    with pytest.raises(TimeoutError, match="did not freeze"):
        CgroupFreezer(str(tmp_path), v2=True).freeze(timeout=0.05)
    assert (tmp_path / "cgroup.freeze").read_text() == "0"
