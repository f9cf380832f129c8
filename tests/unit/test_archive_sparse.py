"""Sparse files in tar_directory / safe_extract: captured as PAX sparse members (GNU 1.0) with their data
regions only, restored with their holes; the sparse map of a crafted archive read strictly.

Real filesystem and tarfile; nothing is mocked. A file with holes is made the way a workload makes
one: written at an offset past its end, or truncated longer.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import UnsafeArchive
from kubectl_snapshot.core.safepath import ExtractLimits
from shim.files import archive
from shim.files.archive import safe_extract, sparse_regions, tar_directory
from shim.host import memwork

MiB = 1 << 20


@pytest.fixture
def box(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(dest, victim): an empty extraction dir and a sibling dir with a file that must survive."""
    dest, victim = tmp_path / "dest", tmp_path / "victim"
    dest.mkdir()
    victim.mkdir()
    (victim / "secret").write_text("keep")
    yield dest, victim
    assert sorted(p.name for p in victim.iterdir()) == ["secret"]
    assert (victim / "secret").read_text() == "keep"


def holed(path: Path, size: int, pieces: dict[int, bytes]) -> Path:
    """A file of `size` bytes holding `pieces` at their offsets and holes elsewhere."""
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in pieces.items():
            f.seek(off)
            f.write(data)
    return path


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def pack(src: Path) -> bytes:
    buf = io.BytesIO()
    tar_directory(str(src), buf)
    return buf.getvalue()


def test_holes_are_neither_archived_nor_written_back(tmp_path: Path, box: tuple[Path, Path]) -> None:
    dest, _ = box
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    holed(src / "big", 256 * MiB, {5 * MiB: b"hello", 128 * MiB: os.urandom(8192)})  # holes around data
    holed(src / "sub" / "tail", 10 * MiB, {0: b"a" * 100_000})  # ends in a hole
    holed(src / "lead", 3 * MiB + 3, {3 * MiB: b"end"})  # starts with one
    holed(src / "empty-but-long", 64 * MiB, {})  # nothing but a hole
    (src / "dense").write_bytes(os.urandom(50_000))
    data = pack(src)
    assert len(data) < 512 * 1024  # 333 MiB of files, a few hundred KiB of data and headers
    report = safe_extract(io.BytesIO(data), str(dest))
    assert report.bytes < 512 * 1024  # what was written: the data regions
    for rel in ("big", "sub/tail", "lead", "empty-but-long", "dense"):
        a, b = src / rel, dest / rel
        assert a.stat().st_size == b.stat().st_size, rel
        assert digest(a) == digest(b), rel
        assert b.stat().st_blocks <= a.stat().st_blocks + 16, rel  # the holes are holes again


def test_other_readers_see_the_real_names_and_contents(tmp_path: Path) -> None:
    """The format is GNU tar's PAX sparse 1.0: CPython's reader (and GNU tar, Go's archive/tar) apply it."""
    src = tmp_path / "src"
    src.mkdir()
    name = b"caf\xe9-\xff".decode("utf-8", "surrogateescape")  # not UTF-8: still its own name
    holed(src / name, 8 * MiB, {1 * MiB: b"x" * 5000})
    (src / "dense").write_bytes(b"d" * 10_000)
    os.utime(src / "dense", ns=(0, 1_700_000_000_000_000_000))  # whole seconds: no PAX record at all
    with tarfile.open(fileobj=io.BytesIO(pack(src))) as t:
        members = {m.name: m for m in t.getmembers()}
        assert set(members) == {name, "dense"}
        sparse = members[name]
        assert sparse.size == 8 * MiB and sparse_regions(sparse) == [(1 * MiB, 8192), (8 * MiB, 0)]
        assert t.extractfile(sparse).read() == (src / name).read_bytes()  # type: ignore[union-attr]
        assert sparse_regions(members["dense"]) is None and not members["dense"].pax_headers  # a plain member


def test_a_file_without_holes_stays_a_plain_member(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(os.urandom(3 * 4096))
    data = pack(tmp_path)
    assert b"GNU.sparse" not in data


def test_too_many_regions_are_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive, "MAX_SPARSE_SEGMENTS", 4)
    src = tmp_path / "src"
    src.mkdir()
    holed(src / "ok", 1 * MiB, {i * 64 * 1024: b"x" for i in range(4)})
    pack(src)  # four regions and a trailing hole: recorded
    holed(src / "many", 1 * MiB, {i * 64 * 1024: b"x" for i in range(5)})
    out = io.BytesIO()
    with pytest.raises(UnsafeArchive, match="more than 4 separate data regions"):
        tar_directory(str(src), out)
    assert b"many" not in out.getvalue()


def test_limits_count_the_data_not_the_holes(tmp_path: Path, box: tuple[Path, Path]) -> None:
    dest, _ = box
    src = tmp_path / "src"
    src.mkdir()
    holed(src / "big", 1 << 30, {512 * MiB: b"y" * 8192})
    data = pack(src)
    safe_extract(io.BytesIO(data), str(dest), limits=ExtractLimits(max_total_bytes=MiB, max_member_bytes=MiB))
    assert (dest / "big").stat().st_size == 1 << 30
    for f in dest.iterdir():
        f.unlink()
    tight = ExtractLimits(max_total_bytes=4096, max_member_bytes=4096)
    with pytest.raises(UnsafeArchive, match="over the per-member limit"):
        safe_extract(io.BytesIO(data), str(dest), limits=tight)


def test_the_layer_is_sized_by_what_its_files_hold(tmp_path: Path) -> None:
    holed(tmp_path / "big", 1 << 30, {0: b"z" * 8192})
    (tmp_path / "small").write_bytes(b"s" * 100)
    size = memwork.tree_size(str(tmp_path))
    assert size is not None and 8192 + 100 <= size < 64 * 1024  # never the 1 GiB of holes


# --- crafted sparse members ------------------------------------------------------------------------


def crafted(mapping: bytes, data: bytes = b"", *, realsize: int = 1 << 20, pax: dict[str, str] | None = None) -> bytes:
    """One sparse member as GNU 1.0 lays it out, with the map and headers given."""
    headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "victim-name"}
    headers["GNU.sparse.realsize"] = str(realsize)
    headers.update(pax or {})
    body = mapping + b"\0" * (-len(mapping) % 512) + data
    ti = tarfile.TarInfo("GNUSparseFile.0/data")
    ti.size = len(body)
    ti.pax_headers = headers
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        t.addfile(ti, io.BytesIO(body))
    return buf.getvalue()


def test_a_well_formed_crafted_member_extracts(box: tuple[Path, Path]) -> None:
    dest, _ = box
    safe_extract(io.BytesIO(crafted(b"2\n4096\n3\n8192\n2\n", b"abcde")), str(dest))
    got = (dest / "victim-name").read_bytes()
    assert len(got) == 1 << 20 and got[4096:4099] == b"abc" and got[8192:8194] == b"de" and got.count(0) == len(got) - 5


@pytest.mark.timeout(20)  # a refusal, never a hang on a map that never ends
@pytest.mark.parametrize(
    ("mapping", "data", "pax", "match"),
    [
        (b"1000\n0\n5\n", b"hello", {}, "cut short"),  # claims 1000 regions, holds one
        (b"99999999\n", b"", {}, "regions"),  # more than the limit
        (b"1\n" + b"9" * 600, b"", {}, "cut short or malformed"),  # a number that never ends
        (b"1\n-5\n5\n", b"hello", {}, "decimal"),
        (b"1\n+5\n5\n", b"hello", {}, "decimal"),
        (b"1\n1_0\n5\n", b"hello", {}, "decimal"),
        (b"2\n100\n5\n50\n5\n", b"helloworld", {}, "out of order"),  # unsorted
        (b"2\n0\n10\n5\n5\n", b"helloworld!!!!!", {}, "overlapping"),
        (b"1\n1048575\n5\n", b"hello", {}, "past the file's size"),
        (b"1\n0\n5000\n", b"hello", {}, "more data than the member holds"),
        (b"1\n0\n5\n", b"hello", {"GNU.sparse.realsize": "lots"}, "realsize"),
    ],
)
def test_a_malformed_sparse_map_is_refused(
    box: tuple[Path, Path], mapping: bytes, data: bytes, pax: dict[str, str], match: str
) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive, match=match):
        safe_extract(io.BytesIO(crafted(mapping, data, pax=pax)), str(dest))


@pytest.mark.parametrize(
    "pax",
    [
        {"GNU.sparse.map": "0,5", "GNU.sparse.size": "1048576", "GNU.sparse.major": "0", "GNU.sparse.minor": "1"},
        {"GNU.sparse.size": "1048576", "GNU.sparse.major": "0", "GNU.sparse.minor": "0"},
    ],
)
def test_other_sparse_formats_are_refused(box: tuple[Path, Path], pax: dict[str, str]) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive, match="not a format kubectl-snapshot writes"):
        safe_extract(io.BytesIO(crafted(b"", b"hello", pax=pax)), str(dest))


def test_old_gnu_sparse_members_are_refused(box: tuple[Path, Path]) -> None:
    dest, _ = box
    ti = tarfile.TarInfo("old")
    ti.type = tarfile.GNUTYPE_SPARSE
    ti.size = 5
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        t.addfile(ti, io.BytesIO(b"hello"))
    with pytest.raises(UnsafeArchive, match="old GNU sparse"):
        safe_extract(io.BytesIO(buf.getvalue()), str(dest))
