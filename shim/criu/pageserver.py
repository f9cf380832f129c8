"""The agent's page server for a lazy restore: answers ``criu lazy-pages --page-server`` from a PageSource.

``criu lazy-pages --page-server --address A --port P -D IMAGES -W WORK`` holds the restored tasks'
userfaultfds; each page fault (and, once the restore is done, its background transfer, in address
order) becomes a ``PS_IOV_GET`` on one TCP connection to A:P (the protocol: shim/criu/pageproto.py).
`PageServer` listens there and answers each in order with pages from its source; when the daemon has
every page it sends ``PS_IOV_CLOSE`` (``PS_IOV_FORCE_CLOSE`` on a socket it was given), is answered, and
exits. Better than a port, which any local process could connect to first (and read a pod's memory
through): `PageServer.over_socketpair`, whose other end the daemon gets as ``--ps-socket FD``.

What CRIU does when the pages stop coming (tests/integration/test_lazy_restore.py records it):
- a page server that stops answering leaves the faulting thread blocked in the kernel and the daemon
  waiting, without any timeout, for ever;
- a page server that closes its connection makes the daemon exit, which closes the userfaultfds: the
  kernel then fills every page not yet copied with zeros and the process runs on with its memory
  silently wrong.
So a range the source cannot give after its retries is a failure the page server reports to
`on_failure` (the agent kills the restored container there, with the reason in an Event) *before* it
closes the connection: the thread blocked in the fault is killed while its page is still missing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shim.criu.pageproto import (
    PAGE_SIZE,
    PS_IOV_CLOSE,
    PS_IOV_FORCE_CLOSE,
    PS_IOV_GET,
    Iov,
    PageSource,
    ProtocolError,
    close_reply,
    decode_iov,
    iov_layout,
    pages_reply,
)


@dataclass
class ServeStats:
    """What one connection asked and got. Times are time.monotonic()."""

    requests: int = 0
    pages: int = 0
    connected_at: float | None = None
    first_request_at: float | None = None
    closed_at: float | None = None  # the daemon's PS_IOV_CLOSE answered
    retries: int = 0
    error: str | None = None
    failed_range: tuple[int, int, int] | None = None  # (dst_id, vaddr, nr_pages) that could not be served
    served: list[tuple[int, int, int]] = field(default_factory=list)  # (dst_id, vaddr, nr_pages) in order


class PageServerError(Exception):
    pass


class PageServer:
    """One lazy restore's page server: one connection from its ``criu lazy-pages`` daemon."""

    def __init__(
        self,
        source: PageSource,
        *,
        criu_version: str,
        address: str = "127.0.0.1",
        port: int = 0,
        retries: int = 3,
        retry_delay_s: float = 0.2,
        request_timeout_s: float = 30.0,
        accept_timeout_s: float = 120.0,
        on_failure: Callable[[str], None] | None = None,
        record: bool = False,
        connected: socket.socket | None = None,
    ) -> None:
        self._source = source
        self._layout = iov_layout(criu_version)
        self._retries = retries
        self._retry_delay_s = retry_delay_s
        self._request_timeout_s = request_timeout_s
        self._accept_timeout_s = accept_timeout_s
        self._on_failure = on_failure
        self._record = record
        # a connected socket (one end of a socketpair, the other given to the daemon as --ps-socket) or
        # a TCP listener on address:port, which any local process could connect to first
        self._listener = None if connected is not None else socket.create_server((address, port))
        self._conn: socket.socket | None = connected
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="page-source")
        self.stats = ServeStats()

    @classmethod
    def over_socketpair(cls, source: PageSource, **kwargs: Any) -> tuple[PageServer, socket.socket]:
        """A page server on one end of a Unix socketpair, and the other end (inheritable) for ``criu
        lazy-pages --page-server --ps-socket FD``: no port, nothing another local process can reach."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.set_inheritable(True)
        return cls(source, connected=ours, **kwargs), theirs

    @property
    def port(self) -> int:
        if self._listener is None:
            raise PageServerError("this page server serves a connected socket, not a port")
        return int(self._listener.getsockname()[1])

    def start(self) -> PageServer:
        self._thread = threading.Thread(target=self._run, name="page-server", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> ServeStats:
        """The connection's stats once it is over (CLOSE answered, failed, or stopped)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise PageServerError(f"the page server is still serving after {timeout} s")
        return self.stats

    def stop(self) -> None:
        """End the connection now (whatever the daemon still waits for) and stop listening."""
        self._stopping.set()
        for s in (self._conn, self._listener):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        if self._listener is not None:
            self._listener.close()
        if self._thread is not None:
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        try:
            if self._listener is not None:
                self._listener.settimeout(self._accept_timeout_s)
                try:
                    accepted, _ = self._listener.accept()
                except TimeoutError:
                    self.stats.error = f"no lazy-pages daemon connected within {self._accept_timeout_s} s"
                    return
                self._listener.close()
                accepted.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._conn = accepted
            conn = self._conn
            if conn is None:
                return
            conn.settimeout(None)
            self.stats.connected_at = time.monotonic()
            with conn:
                self._serve(conn)
        except OSError as e:
            if not self._stopping.is_set():
                self.stats.error = f"page server: {e}"

    def _serve(self, conn: socket.socket) -> None:
        size = self._layout.size
        while True:
            head = _recv_exact(conn, size)
            if not head:
                if self.stats.closed_at is None and not self._stopping.is_set():
                    self.stats.error = "the lazy-pages daemon closed the connection without PS_IOV_CLOSE"
                return
            try:
                iov = decode_iov(head, self._layout)
            except ProtocolError as e:
                self._fail(str(e), None)
                return
            if iov.cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                conn.sendall(close_reply(0))
                self.stats.closed_at = time.monotonic()
                return
            if iov.cmd != PS_IOV_GET:
                self._fail(f"a lazy-pages daemon sends only GET and CLOSE, got command {iov.cmd}", None)
                return
            self.stats.requests += 1
            if self.stats.first_request_at is None:
                self.stats.first_request_at = time.monotonic()
            data = self._fetch(iov)
            if data is None:
                return
            n = len(data) // PAGE_SIZE
            _send_all(conn, [pages_reply(iov, n).encode(self._layout), data])
            self.stats.pages += n
            if self._record:
                self.stats.served.append((iov.dst_id, iov.vaddr, n))

    def _fetch(self, iov: Iov) -> bytes | bytearray | memoryview | None:
        """The pages of a GET from the source, with retries; None once it has failed (reported)."""
        where = (iov.dst_id, iov.vaddr, iov.nr_pages)
        last = ""
        for attempt in range(self._retries + 1):
            if self._stopping.is_set():
                return None
            if attempt:
                self.stats.retries += 1
                time.sleep(self._retry_delay_s * attempt)
            future = self._pool.submit(self._source.pages, iov.dst_id, iov.vaddr, iov.nr_pages)
            try:
                data = future.result(timeout=self._request_timeout_s)
            except KeyError as e:  # the source holds no such page: asking again will not help
                self._fail(f"task {iov.dst_id} has no lazy page at {iov.vaddr:#x}: {e}", where)
                return None
            except concurrent.futures.TimeoutError:
                future.cancel()
                last = f"no answer within {self._request_timeout_s} s"
                continue
            except Exception as e:  # the source's own errors (OSError, HTTP, digest): retried
                last = f"{type(e).__name__}: {e}"
                continue
            if not data or len(data) % PAGE_SIZE or len(data) > iov.length:
                self._fail(f"the page source gave {len(data)} bytes for {iov.nr_pages} pages", where)
                return None
            return data
        self._fail(
            f"pages {iov.vaddr:#x}+{iov.nr_pages} of task {iov.dst_id} could not be fetched after "
            f"{self._retries + 1} tries: {last}",
            where,
        )
        return None

    def _fail(self, reason: str, where: tuple[int, int, int] | None) -> None:
        """Report first (the container is killed while the fault still blocks), then drop the connection."""
        self.stats.error = reason
        self.stats.failed_range = where
        if self._on_failure is not None:
            try:
                self._on_failure(reason)
            except Exception as e:  # the connection is dropped whatever the callback did
                self.stats.error = f"{reason}; and on_failure raised {type(e).__name__}: {e}"


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    """`size` bytes, or b"" where the peer closed before the first; a close inside a message raises."""
    buf = bytearray()
    while len(buf) < size:
        chunk = conn.recv(size - len(buf))
        if not chunk:
            if not buf:
                return b""
            raise ProtocolError(f"connection closed inside a message ({len(buf)} of {size} bytes)")
        buf += chunk
    return bytes(buf)


def _send_all(conn: socket.socket, parts: list[bytes | bytearray | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = conn.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
