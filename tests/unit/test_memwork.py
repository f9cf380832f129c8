"""The memory work area (shim/host/memwork.py) on this machine's /dev/shm: which dumps it takes, the checks
that keep it private, and that it leaves nothing behind."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.engine.staging import StatePaths
from shim.host import memwork, reaper
from shim.host.mounts import mount_of, parse_mountinfo

MIB = 1 << 20


def _on_tmpfs(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        m = mount_of(path, parse_mountinfo(f.read()))
    return m is not None and m.fstype == "tmpfs"


pytestmark = pytest.mark.skipif(not _on_tmpfs("/dev/shm"), reason="needs /dev/shm on a tmpfs")


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    b = Path(f"/dev/shm/ks-test-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv(memwork.ENV_DIR, str(b))
    monkeypatch.setenv(memwork.ENV_MIB, "256")
    monkeypatch.setattr(memwork, "_warned", set())
    yield b
    import shutil

    shutil.rmtree(b, ignore_errors=True)


def test_a_dump_that_fits_gets_a_private_directory_in_memory_and_leaves_nothing(base: Path, tmp_path: Path) -> None:
    with memwork.reserve(str(tmp_path), "1-a", 32 * MIB) as d:
        assert d is not None and Path(d).parent == Path(memwork.area_dir(str(tmp_path)))
        assert Path(d).parent.parent == base and os.path.isdir(d)
        assert oct(os.stat(d).st_mode & 0o777) == "0o700" and oct(os.stat(base).st_mode & 0o777) == "0o700"
        Path(d, "pages-1.img").write_bytes(b"x" * 4096)
    assert reaper.drain(10)  # removed after the block, on a thread (shim/host/reaper.py)
    assert not base.exists()  # the area's directories go with the last dump in it


def test_reservations_add_up_within_the_limit(base: Path, tmp_path: Path) -> None:
    with memwork.reserve(str(tmp_path), "1-a", 150 * MIB) as first:
        assert first is not None
        with memwork.reserve(str(tmp_path), "1-b", 150 * MIB) as second:
            assert second is None  # 2 x (150 + 1/8 + 16 MiB) > 256 MiB
        with memwork.reserve(str(tmp_path), "1-c", 40 * MIB) as third:
            assert third is not None
        assert os.path.isdir(first)
    assert reaper.drain(10)
    with memwork.reserve(str(tmp_path), "1-d", 150 * MIB) as again:
        assert again is not None  # released


def test_a_reservation_holds_until_its_directory_is_gone(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dump is removed after the block, off the answer's path; its space stays promised until then."""
    import shutil
    import threading

    go = threading.Event()
    rmtree = shutil.rmtree

    def slow_rmtree(path: str, ignore_errors: bool = False) -> None:
        go.wait(10)
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    with memwork.reserve(str(tmp_path), "1-a", 150 * MIB) as first:
        assert first is not None
        Path(first, "pages-1.img").write_bytes(b"x" * 4096)
    assert not os.path.exists(first)  # taken away at once, under a dot name
    [trash] = memwork.leftovers(str(tmp_path))
    assert os.path.basename(trash) == reaper.PREFIX + "1-a"
    with memwork.reserve(str(tmp_path), "1-b", 150 * MIB) as second:
        assert second is None  # the first's space is not free yet
    go.set()
    assert reaper.drain(10)
    assert not base.exists()
    with memwork.reserve(str(tmp_path), "1-c", 150 * MIB) as third:
        assert third is not None
    assert reaper.drain(10)


@pytest.mark.parametrize("mib", ["0", "300"])
def test_unknown_sizes_a_limit_of_zero_and_dumps_over_the_limit_go_to_disk(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mib: str
) -> None:
    monkeypatch.setenv(memwork.ENV_MIB, mib)
    with memwork.reserve(str(tmp_path), "1-a", None) as d:
        assert d is None
    with memwork.reserve(str(tmp_path), "1-a", 300 * MIB) as d:
        assert d is None
    assert not base.exists()


def test_a_dump_over_the_limit_on_its_own_never_touches_the_area(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def touched(area: str) -> bool:
        raise AssertionError(f"{area} was checked for a dump that cannot fit")

    monkeypatch.setattr(memwork, "_usable", touched)
    with memwork.reserve(str(tmp_path), "1-a", 256 * MIB) as d:  # 256 + 1/8 + 16 MiB > the 256 MiB limit
        assert d is None


def test_a_directory_not_on_a_tmpfs_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _on_tmpfs(str(tmp_path)):
        pytest.skip("the test's temporary directory is on a tmpfs here")
    monkeypatch.setenv(memwork.ENV_DIR, str(tmp_path / "area"))
    with memwork.reserve(str(tmp_path / "state"), "1-a", MIB) as d:
        assert d is None
    assert not (tmp_path / "area").exists()  # what the check made is gone again


@pytest.mark.parametrize("plant", ["world-writable", "symlink"])
def test_a_directory_someone_else_could_write_is_never_used(base: Path, tmp_path: Path, plant: str) -> None:
    if plant == "world-writable":
        base.mkdir()
        base.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir()
        base.symlink_to(tmp_path / "elsewhere")
    with memwork.reserve(str(tmp_path), "1-a", MIB) as d:
        assert d is None
    assert not (tmp_path / "elsewhere").exists() or not any((tmp_path / "elsewhere").iterdir())
    if base.is_symlink():
        base.unlink()


def test_leftovers_are_listed_for_recovery_only_in_the_agents_own_area(base: Path, tmp_path: Path) -> None:
    from shim.engine.checkpoint import FROZEN_FILE, recover_interrupted
    from tests.support.fakenode import FakeContainerd

    assert memwork.leftovers(str(tmp_path)) == []
    area = Path(memwork.area_dir(str(tmp_path)))
    other = Path(memwork.area_dir(str(tmp_path / "another-node")))
    for a in (area, other):
        (a / "123-abc").mkdir(parents=True)
        (a / "123-abc" / FROZEN_FILE).write_text(json.dumps(["a"]))
    cd = FakeContainerd({"a"})
    cd.pause_task("a")  # the agent died while "a" was frozen and its dump was in memory
    assert recover_interrupted(cd, StatePaths(str(tmp_path))) == ["a"]
    assert cd.paused == set() and not area.exists()  # its dump, then the emptied area
    assert (other / "123-abc").exists()  # another agent's


def test_the_writable_layer_is_sized_without_following_links(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 1000)
    (tmp_path / "g").write_bytes(b"x" * 24)
    (tmp_path / "link").symlink_to("/dev/zero")
    assert memwork.tree_size(str(tmp_path)) == 1024
    assert memwork.tree_size(str(tmp_path), max_entries=2) is None
    assert memwork.tree_size(str(tmp_path / "missing")) == 0
    assert memwork.tree_size(str(tmp_path / "link")) is None  # the top itself a link: not followed


def test_a_directory_swapped_for_a_link_under_the_walk_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "upper" / "d").mkdir(parents=True)
    (tmp_path / "host").mkdir()
    (tmp_path / "host" / "big").write_bytes(b"x" * 4096)
    real_open = os.open

    def swap_then_open(name: str, flags: int, *a: object, **kw: object) -> int:
        if name == "d" and (tmp_path / "upper" / "d").is_dir():  # between the walk's lstat and its open
            (tmp_path / "upper" / "d").rmdir()
            (tmp_path / "upper" / "d").symlink_to(tmp_path / "host")
        return real_open(name, flags, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", swap_then_open)
    assert memwork.tree_size(str(tmp_path / "upper")) is None  # never 4096 (the host's file)


def test_settings() -> None:
    assert memwork.limit_bytes({}) == memwork.DEFAULT_MIB * MIB
    assert memwork.limit_bytes({memwork.ENV_MIB: "0"}) == 0
    assert memwork.limit_bytes({memwork.ENV_MIB: "x"}) == memwork.DEFAULT_MIB * MIB
    assert memwork.area_dir("/s", {}).startswith(memwork.DEFAULT_DIR + "/")
    assert memwork.area_dir("/s", {}) != memwork.area_dir("/t", {})
