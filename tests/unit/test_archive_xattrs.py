"""Extended attributes in tar_directory / safe_extract: file capabilities, POSIX ACLs and user attributes
recorded as PAX SCHILY.xattr records and set again on restore; the node's own attributes never.

Real filesystem and tarfile; nothing is mocked. Setting security.* and trusted.* needs root.
"""

from __future__ import annotations

import errno
import io
import os
import struct
import tarfile
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import UnsafeArchive
from shim.files import archive
from shim.files.archive import safe_extract, tar_directory

ROOT = os.geteuid() == 0
# struct vfs_cap_data, revision 2: cap_net_bind_service (10) permitted and effective
NET_BIND_CAPS = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def _user_xattrs_supported(path: Path) -> bool:
    probe = path / ".probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            return False
        raise
    finally:
        probe.unlink()


@pytest.fixture
def src(tmp_path: Path) -> Path:
    if not _user_xattrs_supported(tmp_path):
        pytest.skip("the temp dir's filesystem has no user extended attributes")
    d = tmp_path / "src"
    d.mkdir()
    return d


def pack(src: Path) -> bytes:
    buf = io.BytesIO()
    tar_directory(str(src), buf)
    return buf.getvalue()


def test_user_attributes_of_files_and_directories_come_back(src: Path, tmp_path: Path) -> None:
    (src / "dir").mkdir()
    os.setxattr(src / "dir", "user.kind", b"folder")
    (src / "dir" / "f").write_bytes(b"data")
    os.setxattr(src / "dir" / "f", "user.bin", b"\x00\xff\xfe binary \xc3\xa9")  # not UTF-8, NULs
    os.setxattr(src / "dir" / "f", "user.a", b"")
    dest = tmp_path / "dest"
    dest.mkdir()
    safe_extract(io.BytesIO(pack(src)), str(dest))
    assert os.getxattr(dest / "dir", "user.kind") == b"folder"
    assert os.getxattr(dest / "dir" / "f", "user.bin") == b"\x00\xff\xfe binary \xc3\xa9"
    assert os.getxattr(dest / "dir" / "f", "user.a") == b""
    assert (dest / "dir" / "f").read_bytes() == b"data"


def test_the_records_are_what_other_tar_readers_know(src: Path) -> None:
    (src / "f").write_bytes(b"x")
    os.setxattr(src / "f", "user.k", b"v")
    os.utime(src / "f", ns=(0, 1_700_000_000_000_000_000))  # whole seconds: no mtime record beside it
    with tarfile.open(fileobj=io.BytesIO(pack(src))) as t:
        assert t.getmember("f").pax_headers == {"SCHILY.xattr.user.k": "v"}


def test_a_file_without_attributes_is_recorded_as_before(src: Path) -> None:
    (src / "f").write_bytes(b"x")
    assert b"SCHILY" not in pack(src)


@pytest.mark.skipif(not ROOT, reason="file capabilities and trusted.* need root")
def test_file_capabilities_survive_the_owner_change_of_a_restore(src: Path, tmp_path: Path) -> None:
    """chown and writing both clear file capabilities: they are set after both."""
    f = src / "server"
    f.write_bytes(b"#!/bin/sh\n")
    os.chown(f, 1000, 1000)
    os.setxattr(f, "security.capability", NET_BIND_CAPS)
    sparse = src / "sparse-with-caps"
    with open(sparse, "wb") as fh:
        fh.truncate(64 << 20)
        fh.write(b"x")
    os.setxattr(sparse, "security.capability", NET_BIND_CAPS)
    dest = tmp_path / "dest"
    dest.mkdir()
    safe_extract(io.BytesIO(pack(src)), str(dest), allow_special_modes=True)
    for name in ("server", "sparse-with-caps"):
        assert os.getxattr(dest / name, "security.capability") == NET_BIND_CAPS, name
    assert os.stat(dest / "server").st_uid == 1000


@pytest.mark.skipif(not ROOT, reason="file capabilities need root")
def test_file_capabilities_are_left_out_where_special_modes_are(src: Path, tmp_path: Path) -> None:
    """Volumes, CRIU's images: like setuid bits, capabilities come back only with a rootfs diff."""
    (src / "f").write_bytes(b"x")
    os.setxattr(src / "f", "security.capability", NET_BIND_CAPS)
    os.setxattr(src / "f", "user.k", b"v")
    dest = tmp_path / "dest"
    dest.mkdir()
    safe_extract(io.BytesIO(pack(src)), str(dest))
    assert os.listxattr(dest / "f") == ["user.k"]


@pytest.mark.skipif(not ROOT, reason="trusted.* needs root")
def test_the_nodes_own_attributes_are_never_recorded(src: Path) -> None:
    (src / "f").write_bytes(b"x")
    os.setxattr(src / "f", "trusted.overlay.origin", b"host")
    os.setxattr(src / "f", "trusted.other", b"host")
    os.setxattr(src / "f", "user.overlay.redirect", b"host")
    assert b"SCHILY" not in pack(src)


def test_too_many_attributes_are_refused_at_capture(src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "MAX_XATTRS", 2)
    (src / "f").write_bytes(b"x")
    for i in range(3):
        os.setxattr(src / "f", f"user.a{i}", b"v")
    with pytest.raises(UnsafeArchive, match="3 extended attributes"):
        pack(src)


def crafted(records: dict[str, str]) -> bytes:
    ti = tarfile.TarInfo("f")
    ti.size = 1
    ti.pax_headers = records
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        t.addfile(ti, io.BytesIO(b"x"))
    return buf.getvalue()


@pytest.mark.skipif(not ROOT, reason="reading trusted.* needs root")
def test_a_crafted_archive_sets_no_attribute_of_the_node(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    records = {"SCHILY.xattr.trusted.overlay.opaque": "y", "SCHILY.xattr.security.selinux": "system_u:object_r:x"}
    records["SCHILY.xattr.user.ok"] = "1"
    safe_extract(io.BytesIO(crafted(records)), str(dest))
    names = os.listxattr(dest / "f")
    assert "trusted.overlay.opaque" not in names and "security.selinux" not in names
    if "user.ok" not in names:  # the temp dir's filesystem may lack user attributes
        assert not _user_xattrs_supported(tmp_path)


def test_a_crafted_attribute_over_the_kernels_size_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(UnsafeArchive, match=r"extended attribute 'user\.big'"):
        safe_extract(io.BytesIO(crafted({"SCHILY.xattr.user.big": "v" * (65 << 10)})), str(dest))
