"""Turn dumped directories into compressed, digested layer files (tar -> zstd -> sha256 in one pass)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import BinaryIO

import zstandard

from kubectl_snapshot.adapters.archive import tar_directory

ZSTD_LEVEL = 1  # level 1 is the fastest useful level; packaging, not CRIU, is the bottleneck
ZSTD_THREADS = -1  # one compression thread per core


@dataclass(frozen=True)
class LayerFile:
    path: str
    digest: str
    size: int
    raw_size: int


class _HashingFile:
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._h = hashlib.sha256()
        self.size = 0

    def write(self, b: bytes | bytearray | memoryview) -> int:
        self._h.update(b)
        self.size += len(b)
        return self._f.write(b)

    def flush(self) -> None:
        self._f.flush()

    @property
    def digest(self) -> str:
        return "sha256:" + self._h.hexdigest()


class _CountingWriter:
    def __init__(self, inner: zstandard.ZstdCompressionWriter) -> None:
        self._inner = inner
        self.size = 0

    def write(self, b: bytes | bytearray | memoryview) -> int:
        self.size += len(b)
        return int(self._inner.write(b))

    def flush(self) -> None:
        self._inner.flush()


def compress_directory(src: str, dest: str) -> LayerFile:
    """tar `src` (its contents at the archive root) into zstd at `dest`, hashing the compressed bytes."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=ZSTD_THREADS)
    with open(dest, "wb") as raw:
        hashing = _HashingFile(raw)
        with cctx.stream_writer(hashing, closefd=False) as zw:  # type: ignore[arg-type]
            counting = _CountingWriter(zw)
            tar_directory(src, counting)  # type: ignore[arg-type]
        raw.flush()
        os.fsync(raw.fileno())
    return LayerFile(dest, hashing.digest, hashing.size, counting.size)


def compress_file(src: str, dest: str) -> LayerFile:
    """zstd-compress an existing tar file (used for the volumes layer captured while frozen)."""
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=ZSTD_THREADS)
    with open(src, "rb") as fin, open(dest, "wb") as raw:
        hashing = _HashingFile(raw)
        _, _ = cctx.copy_stream(fin, hashing)  # type: ignore[arg-type]
        raw_size = fin.tell()
    return LayerFile(dest, hashing.digest, hashing.size, raw_size)
