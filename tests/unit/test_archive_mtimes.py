"""Modification times come back to the nanosecond: a file the workload touched at 12:00:00.7 is not
restored as 12:00:00.0 (a build tool comparing a target with its source would see a different order).

The fraction travels as a PAX `mtime` record, as GNU tar --format=posix writes it; whole seconds need
none, so a tree of whole-second mtimes is archived byte for byte as before. Real filesystem and
tarfile; nothing is mocked.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from shim.files.archive import mtime_ns, mtime_record, safe_extract, tar_directory

T = 1_796_300_000  # a time in seconds
NS = 1_000_000_000


def pack(src: Path, *, exact_mtimes: bool = True) -> bytes:
    out = io.BytesIO()
    tar_directory(str(src), out, exact_mtimes=exact_mtimes)
    return out.getvalue()


def test_files_dirs_and_links_come_back_to_the_nanosecond(tmp_path: Path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "dir").mkdir(parents=True)
    dest.mkdir()
    (src / "dir" / "f").write_bytes(b"data")
    os.symlink("f", src / "dir" / "link")
    times = {"dir/f": T * NS + 123_456_789, "dir/link": T * NS + 5, "dir": T * NS + 700_000_000}
    for rel, ns in times.items():
        os.utime(src / rel, ns=(ns, ns), follow_symlinks=False)
    data = pack(src)
    assert pack(src) == data  # still deterministic
    safe_extract(io.BytesIO(data), str(dest))
    for rel, ns in times.items():
        assert os.lstat(dest / rel).st_mtime_ns == ns, rel  # the dir's set after its children were written


def test_whole_seconds_need_no_record(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    os.utime(tmp_path / "f", ns=(T * NS, T * NS))
    data = pack(tmp_path)
    assert b"mtime=" not in data
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        assert t.getmember("f").pax_headers == {} and t.getmember("f").mtime == T


def test_without_exact_mtimes_the_fraction_is_left_out(tmp_path: Path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    (src / "f").write_bytes(b"x")
    os.utime(src / "f", ns=(T * NS + 999, T * NS + 999))
    data = pack(src, exact_mtimes=False)
    assert b"mtime=" not in data
    safe_extract(io.BytesIO(data), str(dest))
    assert (dest / "f").stat().st_mtime_ns == T * NS


def test_other_readers_see_the_same_time(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    os.utime(tmp_path / "f", ns=(T * NS + 250_000_000, T * NS + 250_000_000))
    with tarfile.open(fileobj=io.BytesIO(pack(tmp_path))) as t:
        m = t.getmember("f")
        assert m.pax_headers["mtime"] == f"{T}.25" and m.mtime == pytest.approx(T + 0.25)


@pytest.mark.parametrize(
    ("ns", "record"),
    [(T * NS + 1, f"{T}.000000001"), (T * NS + 500_000_000, f"{T}.5"), (T * NS, f"{T}"), (7, "0.000000007")],
)
def test_records_are_written_as_gnu_tar_writes_them(ns: int, record: str) -> None:
    assert mtime_record(ns) == record
    m = tarfile.TarInfo("f")
    m.pax_headers = {"mtime": record}
    assert mtime_ns(m) == ns


@pytest.mark.parametrize("raw", ["", "1e9", "-1.5", "1.2.3", "1.0000000001", "\u0661\u0662", "12345678901234.5", ".5"])
def test_a_record_of_another_shape_falls_back_to_tarfiles_reading(raw: str) -> None:
    """Anything but digits[.up to 9 digits] is left to tarfile's own float (as before this change)."""
    m = tarfile.TarInfo("f")
    m.mtime = 42.5
    m.pax_headers = {"mtime": raw}
    assert mtime_ns(m) == 42_500_000_000


@pytest.mark.parametrize("raw", ["999999999999.5", "1e30", "inf", "-inf", "nan", "-1e30"])
def test_a_crafted_time_is_held_within_what_the_kernel_takes(tmp_path: Path, raw: str) -> None:
    """Before: a PAX mtime of 1e30, inf or nan made the extraction raise OverflowError/ValueError."""
    (tmp_path / "src").mkdir()
    (tmp_path / "dest").mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo("f")
        ti.size = 1
        ti.pax_headers = {"mtime": raw}
        t.addfile(ti, io.BytesIO(b"x"))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as t:
        assert -(1 << 63) <= mtime_ns(t.getmember("f")) < 1 << 63
    buf.seek(0)
    safe_extract(buf, str(tmp_path / "dest"))
    assert (tmp_path / "dest" / "f").read_bytes() == b"x"
