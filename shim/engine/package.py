"""Turn dumped directories into compressed, digested layer files (tar -> zstd -> sha256 in one pass)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO

from kubectl_snapshot.adapters.archive import HashingWriter, compress_to, open_zstd_writer, tar_directory

ZSTD_LEVEL = 1  # the fastest useful level: packaging, not CRIU, is the bottleneck (PLATFORM.md)
ZSTD_THREADS = -1  # one compression worker per core, overlapping with tar


@dataclass(frozen=True)
class LayerFile:
    path: str
    digest: str
    size: int
    raw_size: int


def compress_directory(src: str, dest: str) -> LayerFile:
    """tar `src` (its contents at the archive root) into zstd at `dest`, hashing the compressed bytes."""
    with open(dest, "wb") as raw:
        hashing = HashingWriter(raw)
        with open_zstd_writer(hashing, level=ZSTD_LEVEL, threads=ZSTD_THREADS) as zw:
            counting = _Counting(zw)
            tar_directory(src, counting)
        raw.flush()
        os.fsync(raw.fileno())
    return LayerFile(dest, hashing.digest, hashing.size, counting.size)


def compress_file(src: str, dest: str) -> LayerFile:
    """zstd-compress an existing tar file (the volumes layer captured while frozen)."""
    with open(src, "rb") as fin, open(dest, "wb") as raw:
        hashing = HashingWriter(raw)
        compress_to(fin, hashing, level=ZSTD_LEVEL, threads=ZSTD_THREADS)
        raw_size = fin.tell()
    return LayerFile(dest, hashing.digest, hashing.size, raw_size)


class _Counting:
    """Counts the uncompressed bytes on their way into the compressor."""

    def __init__(self, inner: BinaryIO) -> None:
        self._inner = inner
        self.size = 0

    def write(self, data: bytes, /) -> int:
        self.size += len(data)
        return self._inner.write(data)
