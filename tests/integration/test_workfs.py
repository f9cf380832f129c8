"""The memory work area's tmpfs with large folios (shim/host/workfs.py), mounted and removed for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.host import memwork, reaper, workfs
from shim.host.mounts import current, mount_at

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


@pytest.fixture
def base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    b = Path(f"/dev/shm/ks-workfs-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv(memwork.ENV_DIR, str(b))
    yield b
    for _ in range(4):
        if subprocess.run(["umount", "-l", *[str(p) for p in b.glob("*")]], capture_output=True).returncode:
            break
    shutil.rmtree(b, ignore_errors=True)


def test_an_agents_area_gets_a_tmpfs_with_large_folios_of_its_size(base: Path, tmp_path: Path) -> None:
    area = memwork.area_dir(str(tmp_path / "state"))
    first = workfs.ensure(area, 300 << 20)
    if first.state == "no large folios":
        pytest.skip("this kernel has no huge= for tmpfs")
    assert first.state == "mounted", first
    top = mount_at(area, current())
    assert top is not None and top.source == workfs.SOURCE and top.fstype == "tmpfs"
    assert "huge=within_size" in top.options and "size=307200k" in top.options, top.options
    assert oct(os.stat(area).st_mode & 0o777) == "0o700" and oct(os.stat(base).st_mode & 0o777) == "0o700"
    assert workfs.ensure(area, 300 << 20).state == "kept"  # the next start leaves it
    resized = workfs.ensure(area, 200 << 20)  # the area's limit changed: resized in place
    assert resized.state == "resized" and "size=204800k" in resized.detail, resized
    assert workfs.ensure(area, 300 << 20).state == "resized"
    # memwork takes it as it took /dev/shm's directory: a dump's directory lands on this tmpfs
    with memwork.reserve(str(tmp_path / "state"), "1-a", 64 << 20) as d:
        assert d is not None and os.path.dirname(d) == area
        Path(d, "pages-1.img").write_bytes(os.urandom(1 << 20))
        assert os.statvfs(d).f_blocks * os.statvfs(d).f_frsize == 300 << 20
    assert reaper.drain(10) and os.listdir(area) == []  # the area itself stays: it is a mount point
    assert workfs.remove(area).state == "removed"
    assert mount_at(area, current()) is None
    assert workfs.remove(area).state == "absent"


def test_an_area_holding_a_dump_is_not_mounted_over(base: Path, tmp_path: Path) -> None:
    """A killed agent's dump (and its list of frozen containers) is recover's to read first."""
    area = memwork.area_dir(str(tmp_path / "state"))
    os.makedirs(os.path.join(area, "123-abc"))
    assert workfs.ensure(area, 300 << 20).state == "busy"
    assert mount_at(area, current()) is None and os.listdir(area) == ["123-abc"]


def test_another_mount_there_is_left_alone_and_off_removes_ours(base: Path, tmp_path: Path) -> None:
    area = memwork.area_dir(str(tmp_path / "state"))
    os.makedirs(area)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "someone-elses", area], check=True)
    try:
        assert workfs.ensure(area, 300 << 20).state == "foreign"
        assert workfs.remove(area).state == "foreign"
        assert mount_at(area, current()).source == "someone-elses"  # type: ignore[union-attr]
    finally:
        subprocess.run(["umount", area], check=True)
    if workfs.ensure(area, 300 << 20).state == "no large folios":
        pytest.skip("this kernel has no huge= for tmpfs")
    assert workfs.ensure(area, 0).state == "removed"  # dumps in memory turned off: ours goes
    assert mount_at(area, current()) is None
