"""Byte-stream plumbing for uploads: a hashing sink, and a push pipeline turned into a pulled iterator.

``iter_produced(producer)`` turns a push pipeline (tar -> zstd -> writer) into an iterator of chunks for an
HTTP client that pulls (e.g. ``requests`` chunked upload), with back-pressure.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import queue
import threading
from collections.abc import Callable, Generator
from typing import Any, BinaryIO, cast

from shim.files.archive import CHUNK, ByteSink


class HashingWriter(io.RawIOBase):
    """A write-only stream that sha256-hashes and counts what passes through to `raw` (optional).

    Sits at the end of tar -> zstd -> here -> file/upload so the blob digest is known the moment the
    last byte is written, without reading the blob again. close() does not close `raw`.
    """

    def __init__(self, raw: ByteSink | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._hash.update(view)
        if self._raw is not None:
            self._raw.write(bytes(view) if not isinstance(b, bytes) else b)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        flush = getattr(self._raw, "flush", None)
        if flush is not None and not self.closed:
            flush()

    @property
    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    @property
    def digest(self) -> str:
        """OCI form: ``sha256:<hex>``."""
        return "sha256:" + self._hash.hexdigest()


# --- push -> pull adapter -----------------------------------------------------------------------


class _Cancelled(Exception):
    pass


class _QueueWriter(io.RawIOBase):
    def __init__(self, q: queue.Queue[object], chunk_size: int, cancel: threading.Event) -> None:
        super().__init__()
        self._q, self._size, self._cancel = q, chunk_size, cancel
        self._buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self._buf += view
        while len(self._buf) >= self._size:
            self._put(bytes(self._buf[: self._size]))
            del self._buf[: self._size]
        return len(view)

    def _put(self, item: object) -> None:
        while True:
            if self._cancel.is_set():
                raise _Cancelled()
            try:
                self._q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        if self._buf:
            self._put(bytes(self._buf))
            self._buf.clear()


_DONE = object()


def iter_produced(
    producer: Callable[[BinaryIO], None], *, chunk_size: int = 4 * CHUNK, max_chunks: int = 8
) -> Generator[bytes, None, None]:
    """Run `producer(writer)` in a thread and yield what it writes, in `chunk_size` chunks.

    Bounded queue (`max_chunks`) = back-pressure: the producer waits for the consumer, so memory
    stays at about chunk_size * max_chunks. The producer's exception is re-raised in the consumer;
    if the consumer stops early (closes the generator), the producer is cancelled.
    """
    q: queue.Queue[object] = queue.Queue(maxsize=max_chunks)
    cancel = threading.Event()
    writer = _QueueWriter(q, chunk_size, cancel)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            producer(cast(BinaryIO, writer))
            writer.finish()
        except _Cancelled:
            return
        except BaseException as e:
            failure.append(e)
        with contextlib.suppress(_Cancelled):
            writer._put(_DONE)

    thread = threading.Thread(target=run, name="iter-produced", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                break
            yield cast(bytes, item)
        if failure:
            raise failure[0]
    finally:
        cancel.set()
        thread.join()
