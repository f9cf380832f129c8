"""zstd streams: compressing writers and a decompressing reader whose corrupt input is UnsafeArchive.

The node agent's only compression library (zstandard); the runtime wrapper never imports this module.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import IO, Any, BinaryIO, cast

import zstandard

from kubectl_snapshot.core.errors import UnsafeArchive
from shim.files.archive import CHUNK, ByteSink

# Decoders refuse frames that need a bigger window than this (zstd's own default limit, 128 MiB):
# bounds decoder memory whatever the stream claims.
ZSTD_MAX_WINDOW = 1 << 27
_HINT = "the snapshot is corrupted or was crafted; do not restore it, and take a new snapshot"


def open_zstd_writer(out: ByteSink, *, level: int = 1, threads: int = 0) -> BinaryIO:
    """A zstd compressing stream into `out`; close it (or use ``with``) to end the frame.

    `threads`: 0 compresses in the caller's thread, -1 uses every CPU, n uses n worker threads
    (zstd's multi-threaded mode overlaps compression with the producer; level 1 is ~1.4 GB/s per core).
    Frames carry zstd's content checksum, so corruption is detected by the decoder too, not only
    by the blob digest. Closing it does not close `out`.
    """
    cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
    return cast(BinaryIO, cctx.stream_writer(cast(IO[bytes], out), closefd=False, write_return_read=True))


def compress_to(src: IO[bytes] | Iterable[bytes], out: ByteSink, *, level: int = 1, threads: int = 0) -> None:
    """zstd-compress a reader or an iterable of byte chunks into `out` (one frame, not closed)."""
    if hasattr(src, "read"):
        src = cast(IO[bytes], src)
        cctx = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
        cctx.copy_stream(src, cast(IO[bytes], out), read_size=CHUNK, write_size=CHUNK)
        return
    with open_zstd_writer(out, level=level, threads=threads) as zw:
        for chunk in src:
            zw.write(chunk)


class _ZstdReader(io.RawIOBase):
    """Decompressing reader whose corrupt-input errors are UnsafeArchive, not zstandard internals."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        super().__init__()
        zstd = zstandard
        self._zstd_error: type[BaseException] = zstd.ZstdError
        dctx = zstd.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        self._r = dctx.stream_reader(fileobj, read_size=CHUNK, read_across_frames=True, closefd=False)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        try:
            return self._r.read(size)
        except self._zstd_error as e:
            raise UnsafeArchive(f"corrupt zstd stream: {e}", hint=_HINT) from e

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        cast(Any, self._r).close()
        super().close()


def open_zstd_reader(fileobj: IO[bytes]) -> BinaryIO:
    """Streaming zstd decompression of `fileobj` (all frames), window capped at 128 MiB.

    Feed it to safe_extract; the extraction limits bound the output (decompression bombs).
    Closing it does not close `fileobj`.
    """
    return cast(BinaryIO, _ZstdReader(fileobj))
