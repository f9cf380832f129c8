"""Request bodies for blob uploads: re-readable windows of a file or of bytes, and progress that
never counts a byte twice when an upload is restarted."""

from __future__ import annotations

from collections.abc import Callable, Iterator

ProgressFn = Callable[[int], None]

READ_SIZE = 1 << 20


class Progress:
    """Forwards NEW bytes to a ProgressFn. After ``restart()`` bytes are counted again from zero but
    only reported once they pass the previous high-water mark, so a progress bar never goes back
    and never overshoots the total."""

    def __init__(self, fn: ProgressFn | None) -> None:
        self._fn = fn
        self._done = 0
        self._reported = 0

    def restart(self) -> None:
        self._done = 0

    def add(self, n: int) -> None:
        self._done += n
        if self._fn is not None and self._done > self._reported:
            delta, self._reported = self._done - self._reported, self._done
            self._fn(delta)


class Window:
    """``length`` bytes from ``offset`` of a file (opened lazily, read in 1 MiB pieces) or of a bytes
    object. requests sends it with a Content-Length (``__len__``) and iterates it, so a large blob
    is never held in memory. Single use: the caller makes a new Window per attempt."""

    def __init__(
        self,
        *,
        path: str | None = None,
        data: bytes | bytearray | memoryview | None = None,
        offset: int = 0,
        length: int,
        progress: Progress | None = None,
    ) -> None:
        self._path = path
        self._data = data
        self._offset = offset
        self._length = length
        self._progress = progress

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[bytes]:
        if self._data is not None:
            view = memoryview(self._data)[self._offset : self._offset + self._length]
            for start in range(0, self._length, READ_SIZE):
                piece = bytes(view[start : start + READ_SIZE])
                if self._progress is not None:
                    self._progress.add(len(piece))
                yield piece
            return
        assert self._path is not None
        remaining = self._length
        with open(self._path, "rb") as fh:
            fh.seek(self._offset)
            while remaining > 0:
                piece = fh.read(min(READ_SIZE, remaining))
                if not piece:
                    raise OSError(f"{self._path}: file shrank while it was being uploaded")
                remaining -= len(piece)
                if self._progress is not None:
                    self._progress.add(len(piece))
                yield piece
