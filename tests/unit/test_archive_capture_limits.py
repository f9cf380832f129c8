"""tar_directory refuses, at capture, any tree that safe_extract would refuse on restore under the same
limits (entries, one file's data, the archive's data): a snapshot that no node can restore is not
taken. The two sides must count alike, so each limit is checked at its exact boundary on both.

Real filesystem and tarfile; nothing is mocked.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import UnsafeArchive
from kubectl_snapshot.core.safepath import ExtractLimits
from shim.files.archive import safe_extract, tar_directories, tar_directory

MiB = 1 << 20


def tree(root: Path) -> Path:
    """Directories, files, a symlink, a hard link, a fifo and an empty dir: 9 entries below `root`."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a" / "f1").write_bytes(b"x" * 100)
    (root / "a" / "b" / "f2").write_bytes(b"y" * 50)
    os.link(root / "a" / "f1", root / "a" / "hard")  # a link member: counted, no data
    os.symlink("f1", root / "a" / "sym")
    os.mkfifo(root / "fifo")
    (root / "top").write_bytes(b"z" * 10)
    return root


def captured(src: Path, limits: ExtractLimits, arcname: str = "") -> bytes:
    out = io.BytesIO()
    tar_directory(str(src), out, arcname=arcname, limits=limits)
    return out.getvalue()


def restorable(data: bytes, dest: Path, limits: ExtractLimits) -> bool:
    dest.mkdir()
    try:
        safe_extract(io.BytesIO(data), str(dest), limits=limits, allow_fifos=True)  # as a volume's
    except UnsafeArchive:
        return False
    return True


@pytest.mark.parametrize("arcname", ["", "vol"])
def test_the_entry_count_is_the_restore_side_count(tmp_path: Path, arcname: str) -> None:
    src = tree(tmp_path / "src")
    n = 9 + (1 if arcname else 0)  # with an arcname the root is an entry too
    data = captured(src, ExtractLimits(max_members=n), arcname)
    assert restorable(data, tmp_path / "d1", ExtractLimits(max_members=n))
    assert not restorable(data, tmp_path / "d2", ExtractLimits(max_members=n - 1))
    with pytest.raises(UnsafeArchive, match=f"more than {n - 1} files and directories") as e:
        captured(src, ExtractLimits(max_members=n - 1), arcname)
    assert "persistent volume" in (e.value.hint or "")


def test_one_files_data_is_bounded_as_on_restore(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    data = captured(src, ExtractLimits(max_member_bytes=100))  # f1 holds exactly 100 bytes
    assert restorable(data, tmp_path / "d1", ExtractLimits(max_member_bytes=100))
    assert not restorable(data, tmp_path / "d2", ExtractLimits(max_member_bytes=99))
    with pytest.raises(UnsafeArchive, match=r"'a/f1': this file would hold more than 99 bytes"):
        captured(src, ExtractLimits(max_member_bytes=99))


def test_the_archives_data_is_bounded_as_on_restore(tmp_path: Path) -> None:
    src = tree(tmp_path / "src")
    total = 100 + 50 + 10  # the hard link adds no data
    data = captured(src, ExtractLimits(max_total_bytes=total))
    assert restorable(data, tmp_path / "d1", ExtractLimits(max_total_bytes=total))
    assert not restorable(data, tmp_path / "d2", ExtractLimits(max_total_bytes=total - 1))
    with pytest.raises(UnsafeArchive, match=f"the archive would hold more than {total - 1} bytes"):
        captured(src, ExtractLimits(max_total_bytes=total - 1))


def test_holes_do_not_count(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "holed", "wb") as f:  # 64 MiB long, 8 KiB of data
        f.truncate(64 * MiB)
        f.seek(MiB)
        f.write(os.urandom(8192))
    limits = ExtractLimits(max_member_bytes=8192, max_total_bytes=8192)
    data = captured(src, limits)
    assert restorable(data, tmp_path / "d", limits)
    assert (tmp_path / "d" / "holed").stat().st_size == 64 * MiB
    with pytest.raises(UnsafeArchive, match="this file would hold more than 8191 bytes"):
        captured(src, ExtractLimits(max_member_bytes=8191))


def test_several_trees_share_one_budget(tmp_path: Path) -> None:
    """Volumes go into one tar (tar_directories): the restore counts that tar as a whole."""
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
        (d / "f").write_bytes(b"q" * 10)
    tar_directories([("v1", str(one)), ("v2", str(two))], io.BytesIO(), limits=ExtractLimits(max_members=4))
    with pytest.raises(UnsafeArchive, match="more than 3 files"):
        tar_directories([("v1", str(one)), ("v2", str(two))], io.BytesIO(), limits=ExtractLimits(max_members=3))


def test_the_default_is_the_restores_default(tmp_path: Path) -> None:
    """Without `limits` both sides use ExtractLimits(): 1,000,000 entries, 64 GiB."""
    src = tree(tmp_path / "src")
    data = captured(src, ExtractLimits())
    out = io.BytesIO()
    tar_directory(str(src), out)
    assert out.getvalue() == data
    limits = ExtractLimits()
    assert (limits.max_members, limits.max_member_bytes, limits.max_total_bytes) == (1_000_000, 64 << 30, 64 << 30)
