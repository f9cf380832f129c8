"""Collect a process's stdout/stderr through named pipes, the way ``ctr task exec`` does.

containerd's runc shim writes a process's output either to a file (``file://`` URI, stdout and stderr
merged into one file) or to FIFOs given as plain paths, which it opens for writing when the process
starts and closes once the output is drained. FIFOs keep the two streams apart and tell us, by EOF,
that everything was delivered.

Each FIFO is opened for reading without blocking, and a placeholder writer of our own keeps the read
end from seeing EOF before the shim has connected; ``close_writers()`` drops the placeholders once the
process has exited (or never started), after which readers finish when the shim closes its end.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from types import TracebackType


class _Reader:
    def __init__(self, path: Path, limit: int) -> None:
        os.mkfifo(path, 0o600)
        self.path = path
        self._rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._wfd: int | None = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        flags = fcntl.fcntl(self._rfd, fcntl.F_GETFL)
        fcntl.fcntl(self._rfd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        self._limit = limit
        self._chunks: list[bytes] = []
        self._size = 0
        self._thread = threading.Thread(target=self._run, name=f"fifo-{path.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                chunk = os.read(self._rfd, 65536)
                if not chunk:
                    return
                if self._size < self._limit:
                    keep = chunk[: self._limit - self._size]
                    self._chunks.append(keep)
                    self._size += len(keep)
        finally:
            os.close(self._rfd)

    def close_writer(self) -> None:
        if self._wfd is not None:
            os.close(self._wfd)
            self._wfd = None

    def result(self, timeout: float) -> bytes:
        self._thread.join(timeout)
        return b"".join(self._chunks)


class OutputFifos:
    """Two FIFOs (stdout, stderr) under `directory`, read in background threads (up to `limit` bytes each)."""

    def __init__(self, directory: str | os.PathLike[str], *, limit: int = 16 << 20) -> None:
        base = Path(directory)
        self._out = _Reader(base / "stdout", limit)
        self._err = _Reader(base / "stderr", limit)

    @property
    def stdout_path(self) -> str:
        return str(self._out.path)

    @property
    def stderr_path(self) -> str:
        return str(self._err.path)

    def close_writers(self) -> None:
        self._out.close_writer()
        self._err.close_writer()

    def collect(self, timeout: float = 10.0) -> tuple[bytes, bytes]:
        """Wait (up to `timeout` per stream) for the shim to close its ends; return what was read."""
        self.close_writers()
        return self._out.result(timeout), self._err.result(timeout)

    def __enter__(self) -> OutputFifos:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close_writers()
