"""safe_extract against crafted archives (threat model C1-C4) and the tar/zstd/sha256 stream pieces.

Real filesystem, real tarfile and zstandard; nothing is mocked. Every refusal test also checks that
nothing appeared outside the destination and that the victim outside it is untouched.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
import zstandard

from kubectl_snapshot.core.errors import UnsafeArchive
from kubectl_snapshot.core.safepath import ExtractLimits
from shim.files.archive import safe_extract, tar_directory
from shim.files.pipes import HashingWriter, iter_produced
from shim.files.zstdio import compress_to, open_zstd_reader, open_zstd_writer
from tests.support.tarcraft import Entry, craft_tar, dev, dir_, hard, reg, sym

ROOT = os.geteuid() == 0


@pytest.fixture
def box(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(dest, victim): an empty extraction dir and a sibling dir with a file that must survive."""
    dest = tmp_path / "dest"
    victim = tmp_path / "victim"
    dest.mkdir()
    victim.mkdir()
    (victim / "secret").write_text("keep")
    yield dest, victim
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "victim"]
    assert sorted(p.name for p in victim.iterdir()) == ["secret"]
    assert (victim / "secret").read_text() == "keep"


def extract(data: bytes, dest: Path, **kw: object) -> object:
    return safe_extract(io.BytesIO(data), str(dest), **kw)  # type: ignore[arg-type]


def snapshot_tree(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything tar_directory promises to keep, per relative path."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            rel = str(p.relative_to(root))
            common = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = (*common, os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = (*common, int(st.st_mtime), p.read_bytes(), st.st_nlink)
            else:
                out[rel] = (*common, int(st.st_mtime))
    return out


def make_tree(src: Path) -> None:
    (src / "d" / "e").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "d" / "e" / "f.txt").write_bytes(b"hello\n")
    (src / "big").write_bytes(os.urandom(3 << 20))
    (src / "ro").write_text("ro")
    (src / "ro").chmod(0o444)
    (src / "exe").write_text("#!/bin/sh\n")
    (src / "exe").chmod(0o750)
    (src / "link").symlink_to("d/e/f.txt")
    (src / "d" / "up").symlink_to("../big")
    os.link(src / "big", src / "d" / "big-hard")
    (src / "d").chmod(0o711)
    os.utime(src / "ro", (1_600_000_000, 1_600_000_000))
    os.utime(src / "d" / "e", (1_500_000_000, 1_500_000_000))
    if ROOT:
        os.chown(src / "exe", 1234, 5678)


def test_round_trip_through_zstd_and_hash(tmp_path: Path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    make_tree(src)
    sink = io.BytesIO()
    hw = HashingWriter(sink)
    with open_zstd_writer(hw, level=1, threads=2) as zw:
        tar_directory(str(src), zw)
    blob = sink.getvalue()
    assert hw.size == len(blob)
    assert hw.digest == "sha256:" + hashlib.sha256(blob).hexdigest()

    report = safe_extract(open_zstd_reader(io.BytesIO(blob)), str(dest))
    assert snapshot_tree(dest) == snapshot_tree(src)
    assert report.members == len(snapshot_tree(src))
    assert report.bytes == (3 << 20) + 6 + 2 + 10  # hard link data counted once
    assert (dest / "big").stat().st_ino == (dest / "d" / "big-hard").stat().st_ino


def test_tar_is_deterministic_sorted_and_skips_sockets(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "agent.sock"))
    try:
        first, second = io.BytesIO(), io.BytesIO()
        tar_directory(str(src), first, arcname="checkpoint")
        os.utime(src, (1, 1))  # the root's own metadata counts only through arcname's entry
        tar_directory(str(src), second, arcname="checkpoint")
    finally:
        sock.close()
    with tarfile.open(fileobj=io.BytesIO(first.getvalue())) as tf:
        names = tf.getnames()
    assert "checkpoint/agent.sock" not in names
    assert names[0] == "checkpoint"
    assert names == sorted(names, key=lambda n: n.encode())
    third = io.BytesIO()
    tar_directory(str(src), third, arcname="checkpoint")
    assert third.getvalue() == second.getvalue()
    with tarfile.open(fileobj=io.BytesIO(first.getvalue())) as tf:
        assert all(m.uname == "" and m.gname == "" for m in tf.getmembers())
        assert tf.getmember("checkpoint/d/big-hard").islnk()


def test_tar_directory_does_not_follow_symlinked_dirs(tmp_path: Path) -> None:
    src, outside = tmp_path / "src", tmp_path / "outside"
    src.mkdir()
    outside.mkdir()
    (outside / "host-secret").write_text("x")
    (src / "escape").symlink_to(outside)
    buf = io.BytesIO()
    tar_directory(str(src), buf)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        assert tf.getnames() == ["escape"]
        assert tf.getmember("escape").issym()


def test_on_entry_filters(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    seen: list[str] = []

    def keep(rel: str, st: os.stat_result, fd: int | None) -> bool:
        seen.append(rel)
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
            assert fd is not None and os.fstat(fd).st_ino == st.st_ino
        return rel != "d"

    buf = io.BytesIO()
    tar_directory(str(src), buf, on_entry=keep)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tf:
        names = tf.getnames()
    assert not any(n == "d" or n.startswith("d/") for n in names)
    assert "big" in names and "d/e/f.txt" not in seen


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entries",
    [
        [reg("../x", b"pwn")],
        [reg("/etc/x", b"pwn")],
        [reg("a/../../x", b"pwn")],
        [reg("./../x", b"pwn")],
        [reg("x" * 4097, b"pwn")],
        [reg("a", b"1"), reg("a", b"2")],
        [Entry("ok", pax={"path": "a\x00b"})],
    ],
    ids=["dotdot", "absolute", "inner-dotdot", "dot-dotdot", "too-long", "duplicate", "nul"],
)
def test_bad_names_refused(box: tuple[Path, Path], entries: list[Entry]) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive, match="refusing archive member"):
        extract(craft_tar(entries), dest)


def test_symlink_to_absolute_refused(box: tuple[Path, Path]) -> None:
    dest, victim = box
    with pytest.raises(UnsafeArchive, match=r"'d'.*absolute"):
        extract(craft_tar([sym("d", str(victim)), reg("d/secret", b"pwn")]), dest)


def test_write_through_absolute_symlink_refused_even_in_rootfs_mode(box: tuple[Path, Path]) -> None:
    dest, victim = box
    data = craft_tar([sym("d", str(victim)), reg("d/secret", b"pwn")])
    with pytest.raises(UnsafeArchive, match=r"d/secret.*symlink"):
        extract(data, dest, allow_absolute_symlinks=True, overwrite=True)
    assert os.readlink(dest / "d") == str(victim)


@pytest.mark.parametrize(
    "entries",
    [
        [sym("l", "../victim/secret")],
        [dir_("a"), sym("a/l", "../../victim")],
        [sym("l", "."), sym("m", "l/..")],  # lexically "." but physically dest/..
        [sym("b", "a"), sym("a", "../victim")],  # chain
        [sym(".", "../victim")],  # replacing the destination itself (gh-149486)
        [reg("x/f", b""), sym("x", "y")],  # link replacing an (implicitly) extracted directory
        [reg("f", b""), sym("x", "."), reg("x/y", b"")],  # write below an in-archive link
    ],
    ids=["up", "nested-up", "climb-after-descent", "chain", "dest-itself", "dir-replaced", "below-link"],
)
def test_symlink_escapes_refused(box: tuple[Path, Path], entries: list[Entry]) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive):
        extract(craft_tar(entries), dest)


@pytest.mark.parametrize(
    "entries",
    [
        [hard("h", "/etc/shadow")],
        [hard("h", "../victim/secret")],
        [hard("h", "not-in-archive")],
        [sym("s", "f"), reg("f", b"x"), hard("h", "s")],  # hard link to a symlink
        [dir_("d"), hard("h", "d")],
        [reg("f", b"x"), sym("s", "."), hard("s/h", "f")],
    ],
    ids=["absolute", "outside", "unknown", "to-symlink", "to-dir", "below-link"],
)
def test_hardlink_attacks_refused(box: tuple[Path, Path], entries: list[Entry]) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive):
        extract(craft_tar(entries), dest)


def test_preexisting_symlink_in_dest_is_never_followed(box: tuple[Path, Path]) -> None:
    dest, victim = box
    (dest / "d").symlink_to(victim)
    with pytest.raises(UnsafeArchive, match="symlink"):
        extract(craft_tar([reg("d/secret", b"pwn")]), dest, overwrite=True)
    (dest / "f").symlink_to(victim / "secret")
    extract(craft_tar([reg("f", b"replaced")]), dest, overwrite=True)  # replaces the link itself
    assert (dest / "f").read_bytes() == b"replaced" and not (dest / "f").is_symlink()


@pytest.mark.parametrize(
    "entry",
    [
        dev("null", tarfile.CHRTYPE, 1, 3),
        dev("sda", tarfile.BLKTYPE, 8, 0),
        Entry("fifo", tarfile.FIFOTYPE),
        reg("suid", b"x", mode=0o4755),
        reg("sgid", b"x", mode=0o2755),
        reg("sticky", b"x", mode=0o1644),
        Entry("weird", b"Z"),
    ],
    ids=["chr", "blk", "fifo", "setuid", "setgid", "sticky", "unknown-type"],
)
def test_special_files_refused(box: tuple[Path, Path], entry: Entry) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive, match=entry.name):
        extract(craft_tar([entry]), dest)
    assert not (dest / entry.name).exists()


def test_special_modes_allowed_when_asked(tmp_path: Path) -> None:
    extract(craft_tar([reg("suid", b"x", mode=0o4755), dir_("tmp", 0o1777)]), tmp_path, allow_special_modes=True)
    assert stat.S_IMODE((tmp_path / "suid").stat().st_mode) == 0o4755
    assert stat.S_IMODE((tmp_path / "tmp").stat().st_mode) == 0o1777


def test_existing_files_are_not_replaced_without_overwrite(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("old")
    with pytest.raises(UnsafeArchive, match="already exists"):
        extract(craft_tar([reg("f", b"new")]), tmp_path)
    assert (tmp_path / "f").read_text() == "old"
    extract(craft_tar([reg("f", b"new")]), tmp_path, overwrite=True)
    assert (tmp_path / "f").read_text() == "new"


def test_overwrite_replaces_directory_by_file(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "x").write_text("x")
    extract(craft_tar([reg("d", b"now a file")]), tmp_path, overwrite=True)
    assert (tmp_path / "d").read_bytes() == b"now a file"


def test_implicit_parents_then_explicit_dir(tmp_path: Path) -> None:
    extract(craft_tar([reg("a/b/c", b"x"), dir_("a/b", 0o700), dir_("a", 0o750), dir_(".")]), tmp_path)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o750
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
    assert (tmp_path / "a" / "b" / "c").read_bytes() == b"x"


@pytest.mark.parametrize(
    ("limits", "entries", "match"),
    [
        (ExtractLimits(max_members=2), [reg("a"), reg("b"), reg("c")], "more than 2 members"),
        (ExtractLimits(max_member_bytes=10), [reg("a", b"x" * 11)], "per-member limit"),
        (ExtractLimits(max_total_bytes=15), [reg("a", b"x" * 10), reg("b", b"x" * 10)], "15-byte limit"),
    ],
)
def test_limits(box: tuple[Path, Path], limits: ExtractLimits, entries: list[Entry], match: str) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive, match=match):
        extract(craft_tar(entries), dest, limits=limits)


def test_decompression_bomb_stops_at_limit(box: tuple[Path, Path]) -> None:
    """A 256 MiB zero file compresses to a few KiB; the limit refuses it before writing it."""
    dest, _ = box
    hdr = tarfile.TarInfo("zeros")
    hdr.size = 256 << 20
    raw = io.BytesIO()

    def chunks() -> Iterator[bytes]:
        yield hdr.tobuf(tarfile.PAX_FORMAT)
        zero = bytes(1 << 20)
        for _ in range(256):
            yield zero
        yield bytes(1024)

    compress_to(chunks(), raw)
    assert len(raw.getvalue()) < 1 << 20
    with pytest.raises(UnsafeArchive, match="per-member limit"):
        safe_extract(
            open_zstd_reader(io.BytesIO(raw.getvalue())),
            str(dest),
            limits=ExtractLimits(max_member_bytes=64 << 20),
        )
    assert list(dest.iterdir()) == []


def test_oversized_pax_header_refused(box: tuple[Path, Path]) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive, match="extended header"):
        extract(craft_tar([Entry("a", pax={"comment": "x" * (2 << 20)})]), dest)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage" * 300,
        craft_tar([reg("a", b"x" * 5000)])[:1536],
        craft_tar([reg("a", b"x" * 100), reg("b", b"y")])[:1024],  # cut at a member boundary
        craft_tar([reg("a", b"x" * 100)])[:1024] + b"\x01" * 512,  # garbage header after a member
    ],
    ids=["empty", "garbage", "truncated-data", "truncated-at-boundary", "bad-second-header"],
)
def test_corrupt_tar_is_a_typed_error(box: tuple[Path, Path], data: bytes) -> None:
    dest, _ = box
    with pytest.raises(UnsafeArchive, match=r"corrupt|truncated"):
        extract(data, dest)


def test_corrupt_zstd_is_a_typed_error(box: tuple[Path, Path]) -> None:
    dest, _ = box
    good = io.BytesIO()
    compress_to([craft_tar([reg("a", os.urandom(100_000))])], good)  # incompressible: raw blocks
    bad = good.getvalue()[:5000] + b"\xff" + good.getvalue()[5001:]  # caught by the frame checksum
    with pytest.raises(UnsafeArchive, match="corrupt"):
        safe_extract(open_zstd_reader(io.BytesIO(bad)), str(dest))
    with pytest.raises(UnsafeArchive, match="corrupt"):
        open_zstd_reader(io.BytesIO(b"not zstd at all")).read()
    # A zstd stream truncated anywhere is caught by the tar layer (python-zstandard's reader does not
    # report an unfinished frame): at a member boundary, inside data, or inside a header.
    tar = craft_tar([reg("a", b"x" * 5000), reg("b", b"y" * 5000)])
    for cut in (512 + 5120, 5000, 512 + 5120 + 100, 2 * (512 + 5120)):
        blob = zstandard.ZstdCompressor(write_checksum=False).compress(tar[:cut])
        with pytest.raises(UnsafeArchive, match="truncated"):
            safe_extract(open_zstd_reader(io.BytesIO(blob)), str(dest), overwrite=True)


# --- stream helpers -----------------------------------------------------------------------------


def test_compress_to_accepts_readers_and_iterables() -> None:
    data = os.urandom(1 << 16) * 8
    a, b = io.BytesIO(), io.BytesIO()
    compress_to(io.BytesIO(data), a, level=3)
    compress_to([data[:1000], data[1000:]], b, threads=-1)
    for out in (a, b):
        assert open_zstd_reader(io.BytesIO(out.getvalue())).read() == data


def test_iter_produced_streams_with_backpressure(tmp_path: Path) -> None:
    make_tree(tmp_path)

    def produce(w: BinaryIO) -> None:
        with open_zstd_writer(w, threads=-1) as zw:
            tar_directory(str(tmp_path), zw)

    chunks = list(iter_produced(produce, chunk_size=64 << 10, max_chunks=2))
    assert all(len(c) == 64 << 10 for c in chunks[:-1])
    direct = io.BytesIO()
    produce(direct)
    direct.seek(0)
    assert open_zstd_reader(io.BytesIO(b"".join(chunks))).read() == open_zstd_reader(direct).read()


def test_iter_produced_reraises_producer_errors() -> None:
    def produce(w: BinaryIO) -> None:
        w.write(b"partial")
        raise UnsafeArchive("boom")

    it = iter_produced(produce, chunk_size=4)
    with pytest.raises(UnsafeArchive, match="boom"):
        list(it)


def test_iter_produced_cancels_producer_when_consumer_stops() -> None:
    written = 0

    def produce(w: BinaryIO) -> None:
        nonlocal written
        for _ in range(10_000):
            w.write(b"x" * 1024)
            written += 1

    it = iter_produced(produce, chunk_size=1024, max_chunks=2)
    assert next(it) == b"x" * 1024
    it.close()  # joins the producer thread, which must stop instead of blocking forever
    assert written < 100
