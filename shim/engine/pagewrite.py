"""Writing a restored chunk into its page file at disk-cache speed (issue 44, item 1).

Where the time went (bench/staging.py, 2 vCPUs): the download and its digest use both cores, so what the
staging adds must cost little CPU, not only overlap. Per chunk, each worker:

* downloads the blob into a buffer of its own, kept from chunk to chunk (`Into`: one copy, no regrowth,
  no fresh page-faulted memory per chunk), and decompresses it into a second one (`decompress_into`);
* never writes zero pages (`nonzero_runs`): the page file is created empty at its final length, so a page
  not written reads as zeros (a hole: no disk block, no page-cache copy). CRIU reads holes like any page;
* allocates the blocks of each run before writing it (`write_runs`): on ext4 a write into an allocated
  range costs about half the CPU of one into a hole (delayed allocation per page), and a full disk fails
  the allocation cleanly, before the bytes are copied;
* puts a chunk used in several places at its other places from the first one (`share_runs`,
  copy_file_range): a clone where the filesystem shares extents (XFS, btrfs: written once), an in-kernel
  copy elsewhere.

Safety is the caller's (shim/engine/stream.fetch_chunks): a blob is verified against its digest while it
downloads and opened (authenticated) before a byte of it is decompressed, and a page file is written
only at ranges its chunk records own (core/chunks.check_tiling: no overlap), so a hole is never a page
another chunk wrote.
"""

from __future__ import annotations

import errno
import os

import zstandard

from kubectl_snapshot.core.chunks import PAGE_SIZE

ZERO_PAGE = bytes(PAGE_SIZE)
_NO_CLONE = frozenset({errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF})
_NO_ALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})

Runs = list[tuple[int, int]]


class Into:
    """A file-like target for one download: its bytes land in `buf` (grown once to the largest blob)."""

    def __init__(self, buf: bytearray, limit: int) -> None:
        if len(buf) < limit:
            buf.extend(bytes(limit - len(buf)))
        self.buf, self.limit, self.pos = buf, limit, 0

    def write(self, data: bytes, /) -> int:
        end = self.pos + len(data)
        if end > self.limit:  # the registry client stops at its max_size first; never past the buffer
            raise ValueError("more bytes than the blob's declared size")
        self.buf[self.pos : end] = data
        self.pos = end
        return len(data)

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0 or not 0 <= pos <= self.limit:
            raise ValueError("only absolute positions within the blob")
        self.pos = pos
        return pos

    def truncate(self, size: int | None = None) -> int:
        self.pos = self.pos if size is None else size
        return self.pos

    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.pos]


def decompress_into(blob: bytes | bytearray | memoryview, out: bytearray, length: int) -> int:
    """Decompress the zstd frame `blob` into `out` (grown to `length` when smaller); returns the bytes it
    holds, which the caller compares with `length`: one past it means more. Raises zstandard.ZstdError on a
    frame that does not decode (or whose checksum does not match)."""
    if len(out) < length + 1:
        out.extend(bytes(length + 1 - len(out)))
    got = 0
    reader: zstandard.ZstdDecompressionReader | None = None
    try:
        with memoryview(out) as dst:
            reader = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=False)
            while got <= length:
                with dst[got : length + 1] as rest:
                    n = reader.readinto(rest)
                if not n:
                    break
                got += n
            if got == length and reader.read(1):  # consumes the frame's end (its checksum is checked there)
                got += 1
    finally:
        reader = None  # lets go of `blob`'s buffer, even while a traceback holds this frame
    return got


def nonzero_runs(data: bytes | bytearray, length: int) -> Runs:
    """The [start, end) ranges of data[:length] to write: all but its whole zero pages (relative to the
    chunk's start, which is a page of its file in every page file CRIU writes; a partial last page is
    written). A page whose first or last byte is not zero is told at once: most of a busy process's."""
    runs: Runs = []
    start = -1
    zero = ZERO_PAGE
    last = length - length % PAGE_SIZE
    for off in range(0, last, PAGE_SIZE):
        if data[off] == 0 and data[off + PAGE_SIZE - 1] == 0 and data[off : off + PAGE_SIZE] == zero:
            if start >= 0:
                runs.append((start, off))
                start = -1
        elif start < 0:
            start = off
    if start < 0 and last < length:
        start = last
    if start >= 0:
        runs.append((start, length))
    return runs


def write_runs(fd: int, data: memoryview, runs: Runs, offset: int) -> None:
    """data[s:e] at offset+s for each run, its blocks allocated first (where the filesystem can)."""
    for s, e in runs:
        _allocate(fd, offset + s, e - s)
        view, pos = data[s:e], offset + s
        while view:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n


def share_runs(src_fd: int, src_offset: int, fd: int, offset: int, data: memoryview, runs: Runs) -> None:
    """The runs of a chunk already written at src_offset of src_fd put at `offset` of `fd` too: cloned or
    copied by the kernel; written from `data` where the kernel cannot (another filesystem, an old kernel)."""
    for s, e in runs:
        done = 0
        try:
            while done < e - s:
                n = os.copy_file_range(src_fd, fd, e - s - done, src_offset + s + done, offset + s + done)
                if n <= 0:
                    break
                done += n
        except OSError as err:
            if err.errno not in _NO_CLONE:
                raise
        if done < e - s:
            write_runs(fd, data, [(s + done, e)], offset)


def _allocate(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno not in _NO_ALLOCATE:
            raise  # ENOSPC: the disk is full, before a byte was copied
