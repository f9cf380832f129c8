"""Writing restored chunks (shim/engine/pagewrite.py, through stream.fetch_chunks): zero pages stay holes,
a shared chunk's other places hold the same bytes, a blob that decompresses to another length or does not
decompress is refused before a byte of it is written, and downloads land in a worker's own buffer."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import zstandard

from kubectl_snapshot.core.chunks import PAGE_SIZE, Chunk, PagesFile
from kubectl_snapshot.core.errors import DigestMismatch
from kubectl_snapshot.core.reference import Reference
from shim.engine import stream
from shim.engine.pagewrite import Into, decompress_into, nonzero_runs, share_runs, write_runs

P = PAGE_SIZE
REF = Reference.parse("reg.example/ns/app@sha256:" + "0" * 64)


def _pages(*kinds: str) -> bytes:
    """One page per letter: "z" a zero page, "r" random, "e" zero but for its last byte."""
    out = []
    for k in kinds:
        if k == "z":
            out.append(bytes(P))
        elif k == "e":
            out.append(bytes(P - 1) + b"\1")
        else:
            out.append(os.urandom(P))
    return b"".join(out)


def test_zero_pages_are_left_out_of_the_runs_to_write() -> None:
    data = _pages("r", "z", "z", "r", "e", "z", "r", "z")
    assert nonzero_runs(data, len(data)) == [(0, P), (3 * P, 5 * P), (6 * P, 7 * P)]
    assert nonzero_runs(bytes(4 * P), 4 * P) == []
    assert nonzero_runs(_pages("z", "r"), 2 * P) == [(P, 2 * P)]
    # only whole pages are holes; a partial last page is written, and bytes past `length` are not looked at
    assert nonzero_runs(bytes(P + 5), P + 5) == [(P, P + 5)]
    assert nonzero_runs(_pages("z", "r"), P) == []
    # zeros that straddle a page boundary are no zero page
    straddle = bytearray(_pages("r", "r", "r"))
    straddle[P // 2 : P + P // 2 + 8] = bytes(P + 8)
    assert nonzero_runs(straddle, 3 * P) == [(0, 3 * P)]


def test_runs_are_written_and_the_rest_stays_a_hole(tmp_path: Path) -> None:
    data = _pages("r", *"z" * 255, "r")  # 1 MiB: two pages of data around a hole of 255 pages
    fd = os.open(tmp_path / "pages-1.img", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 2 * len(data))
        with memoryview(data) as view:
            write_runs(fd, view, nonzero_runs(data, len(data)), len(data))
        blocks = os.fstat(fd).st_blocks * 512
    finally:
        os.close(fd)
    assert (tmp_path / "pages-1.img").read_bytes() == bytes(len(data)) + data
    assert blocks < 64 * P  # two pages written (the filesystem may round up), not 512


def test_a_shared_chunk_is_put_at_its_other_place_from_its_first(tmp_path: Path) -> None:
    data = _pages("r", "z", "r", "r")
    runs = nonzero_runs(data, len(data))
    src = os.open(tmp_path / "pages-1.img", os.O_RDWR | os.O_CREAT, 0o600)
    dst = os.open(tmp_path / "pages-2.img", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for fd in (src, dst):
            os.ftruncate(fd, 8 * P)
        with memoryview(data) as view:
            write_runs(src, view, runs, 4 * P)
            share_runs(src, 4 * P, dst, 0, view, runs)
            share_runs(src, 4 * P, src, 0, view, runs)  # the same file, another place
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "pages-1.img").read_bytes() == data + data
    assert (tmp_path / "pages-2.img").read_bytes() == data + bytes(4 * P)


def test_a_kernel_that_cannot_copy_gets_the_bytes_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_copy(*_: Any) -> int:
        raise OSError(18, "Invalid cross-device link")  # EXDEV: another filesystem

    monkeypatch.setattr(os, "copy_file_range", no_copy)
    data = _pages("r", "z", "r")
    src = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT, 0o600)
    dst = os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(dst, len(data))
        with memoryview(data) as view:
            share_runs(src, 0, dst, 0, view, nonzero_runs(data, len(data)))
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "b").read_bytes() == data


def test_decompression_fills_the_buffer_and_tells_a_longer_or_shorter_frame() -> None:
    raw = _pages("r", "z", "r")
    frame = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(raw)
    out = bytearray()
    assert decompress_into(frame, out, len(raw)) == len(raw) and out[: len(raw)] == raw
    assert decompress_into(frame, out, len(raw) - P) == len(raw) - P + 1  # more than said
    assert decompress_into(frame, out, len(raw) + P) == len(raw)  # less than said
    assert decompress_into(frame + frame, out, len(raw)) == len(raw) + 1  # a second frame is more
    damaged = bytearray(frame)
    damaged[-1] ^= 1  # the frame's checksum
    with pytest.raises(zstandard.ZstdError):
        decompress_into(bytes(damaged), out, len(raw))


def test_a_download_lands_in_the_buffer_and_restarts_from_its_start() -> None:
    buf = bytearray(3)
    into = Into(buf, 10)
    assert len(buf) >= 10
    into.write(b"abcd")
    into.seek(0)  # the registry client's retry after a lost connection
    into.truncate()
    into.write(b"0123456789")
    with into.view() as v:
        assert bytes(v) == b"0123456789"
    with pytest.raises(ValueError):
        into.write(b"x")  # never past the blob's declared size


class _Blobs:
    """A registry's blob reads (digest -> bytes), counted, written in pieces as the real client does."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs
        self.fetched: list[str] = []

    def fetch_blob(self, ref: object, digest: str, out: Any, **_: Any) -> int:
        self.fetched.append(digest)
        data = self.blobs[digest]
        for i in range(0, len(data), 1000):
            out.write(data[i : i + 1000])
        return len(data)


def _blob(raw: bytes) -> tuple[str, bytes]:
    z = zstandard.ZstdCompressor(level=1).compress(raw)
    return "sha256:" + hashlib.sha256(z).hexdigest(), z


def test_fetched_page_files_hold_every_page_with_zero_pages_as_holes(tmp_path: Path) -> None:
    a = _pages("r", *"z" * 62, "r")  # 256 KiB, mostly zero
    b = bytes(64 * P)  # a chunk all zero: nothing written
    c = _pages(*"r" * 64)
    (da, za), (db, zb), (dc, zc) = _blob(a), _blob(b), _blob(c)
    n = len(a)
    f1 = PagesFile(
        "pages-1.img", 3 * n, (Chunk(0, n, da, len(za)), Chunk(n, n, db, len(zb)), Chunk(2 * n, n, dc, len(zc)))
    )
    f2 = PagesFile("pages-2.img", 2 * n, (Chunk(0, n, dc, len(zc)), Chunk(n, n, da, len(za))))
    reg = _Blobs({da: za, db: zb, dc: zc})
    stream.fetch_chunks(reg, REF, [f1, f2], str(tmp_path), workers=2)  # type: ignore[arg-type]
    assert sorted(reg.fetched) == sorted([da, db, dc])  # each once
    assert (tmp_path / "pages-1.img").read_bytes() == a + b + c
    assert (tmp_path / "pages-2.img").read_bytes() == c + a
    written = (tmp_path / "pages-1.img").stat().st_blocks * 512
    assert written < 2 * n  # `a`'s two pages and `c`; not `b`, nor `a`'s zero pages


@pytest.mark.parametrize("said", [-P, P])
def test_a_chunk_of_another_length_than_recorded_is_refused(tmp_path: Path, said: int) -> None:
    raw = _pages("r", "r", "r", "r")
    d, z = _blob(raw)
    f = PagesFile("pages-1.img", len(raw) + said, (Chunk(0, len(raw) + said, d, len(z)),))
    with pytest.raises(DigestMismatch, match="holds"):
        stream.fetch_chunks(_Blobs({d: z}), REF, [f], str(tmp_path))  # type: ignore[arg-type]
    assert (tmp_path / "pages-1.img").stat().st_blocks == 0  # nothing of it was written


def test_a_blob_that_does_not_decompress_is_refused(tmp_path: Path) -> None:
    d = "sha256:" + hashlib.sha256(b"not zstd").hexdigest()
    f = PagesFile("pages-1.img", P, (Chunk(0, P, d, 8),))
    with pytest.raises(DigestMismatch, match="does not decompress"):
        stream.fetch_chunks(_Blobs({d: b"not zstd"}), REF, [f], str(tmp_path))  # type: ignore[arg-type]
