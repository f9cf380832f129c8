"""The page server over loopback, with a client that speaks as ``criu lazy-pages`` does (criu/page-xfer.c):
GETs pipelined on one connection, answered in order, then CLOSE. The real daemon: test_lazy_restore.py."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from shim.criu import pageproto as pp
from shim.criu.pageproto import PAGE_SIZE
from shim.criu.pageserver import PageServer

L = pp.LAYOUT_32


def page(pid: int, vaddr: int) -> bytes:
    return (f"{pid}:{vaddr:x};".encode() * PAGE_SIZE)[:PAGE_SIZE]


class Source:
    """Pages [0x1000, 0x1000 + 16 pages) of task 1; fails `failures` times first; never serves `bad`."""

    def __init__(self, *, failures: int = 0, bad: int | None = None, hang: threading.Event | None = None) -> None:
        self.failures, self.bad, self.hang, self.calls = failures, bad, hang, 0

    def pages(self, dst_id: int, vaddr: int, nr_pages: int) -> bytes:
        self.calls += 1
        if self.hang is not None:
            self.hang.wait(10)
        if dst_id != 1 or not 0x1000 <= vaddr < 0x1000 + 16 * PAGE_SIZE:
            raise KeyError(vaddr)
        if self.failures:
            self.failures -= 1
            raise OSError("registry: connection reset")
        if vaddr == self.bad:
            raise OSError("registry: 503")
        n = min(nr_pages, (0x1000 + 16 * PAGE_SIZE - vaddr) // PAGE_SIZE)
        return b"".join(page(dst_id, vaddr + i * PAGE_SIZE) for i in range(n))


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return buf
        buf += chunk
    return buf


def connect(server: PageServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def test_pipelined_gets_are_answered_in_order_then_close() -> None:
    server = PageServer(Source(), criu_version="4.2.1", record=True).start()
    with connect(server) as s:
        reqs = [(1, 0x1000 + 2 * PAGE_SIZE, 1), (1, 0x1000, 2), (1, 0x1000 + 14 * PAGE_SIZE, 8)]
        s.sendall(b"".join(pp.get_request(*r).encode(L) for r in reqs))
        for dst, vaddr, n in reqs:
            reply = pp.decode_iov(recv_exact(s, L.size), L)
            got = min(n, (0x1000 + 16 * PAGE_SIZE - vaddr) // PAGE_SIZE)  # the last range is shorter
            assert reply == pp.Iov(pp.PS_IOV_ADD_F, got, vaddr, dst, flags=pp.PE_PRESENT)
            data = recv_exact(s, got * PAGE_SIZE)
            assert data == b"".join(page(dst, vaddr + i * PAGE_SIZE) for i in range(got))
        s.sendall(pp.Iov(pp.PS_IOV_CLOSE).encode(L))
        assert recv_exact(s, 4) == pp.close_reply(0)
    stats = server.wait(5)
    assert stats.error is None and stats.closed_at is not None
    assert stats.requests == 3 and stats.pages == 1 + 2 + 2
    assert stats.served == [(1, 0x1000 + 2 * PAGE_SIZE, 1), (1, 0x1000, 2), (1, 0x1000 + 14 * PAGE_SIZE, 2)]


def test_the_4_1_layout_is_served_when_that_criu_is_the_node_s() -> None:
    server = PageServer(Source(), criu_version="4.1.1").start()
    with connect(server) as s:
        s.sendall(pp.get_request(1, 0x1000, 1).encode(pp.LAYOUT_24))
        assert pp.decode_iov(recv_exact(s, 24), pp.LAYOUT_24).nr_pages == 1
        assert recv_exact(s, PAGE_SIZE) == page(1, 0x1000)
        s.sendall(pp.Iov(pp.PS_IOV_CLOSE).encode(pp.LAYOUT_24))
        assert recv_exact(s, 4) == pp.close_reply(0)
    assert server.wait(5).error is None


def test_a_transient_source_error_is_retried() -> None:
    src = Source(failures=2)
    server = PageServer(src, criu_version="4.2.1", retry_delay_s=0.01).start()
    with connect(server) as s:
        s.sendall(pp.get_request(1, 0x1000, 1).encode(L))
        assert pp.decode_iov(recv_exact(s, L.size), L).nr_pages == 1
        assert recv_exact(s, PAGE_SIZE) == page(1, 0x1000)
        s.sendall(pp.Iov(pp.PS_IOV_CLOSE).encode(L))
        recv_exact(s, 4)
    stats = server.wait(5)
    assert stats.retries == 2 and src.calls == 3 and stats.error is None


def test_a_range_that_cannot_be_fetched_is_reported_before_the_connection_drops() -> None:
    """The container must be killed while its fault still blocks: closing first would let the daemon
    exit and the kernel zero-fill the missing pages (what CRIU does; test_lazy_restore.py)."""
    order: list[str] = []

    def on_failure(reason: str) -> None:
        # the daemon's connection is still open here: nothing was answered, nothing closed
        readable, _, _ = select.select([client], [], [], 0.2)
        assert readable == []
        order.append(reason)

    bad = 0x1000 + 3 * PAGE_SIZE
    server = PageServer(Source(bad=bad), criu_version="4.2.1", retries=2, retry_delay_s=0.01, on_failure=on_failure)
    server.start()
    client = connect(server)
    with client:
        client.sendall(pp.get_request(1, bad, 4).encode(L))
        assert recv_exact(client, 1) == b""  # then dropped, unanswered
    stats = server.wait(5)
    assert len(order) == 1 and "could not be fetched after 3 tries" in order[0] and "503" in order[0]
    assert stats.failed_range == (1, bad, 4) and stats.retries == 2 and stats.pages == 0


def test_a_page_the_source_does_not_hold_fails_at_once() -> None:
    src = Source()
    reasons: list[str] = []
    server = PageServer(src, criu_version="4.2.1", on_failure=reasons.append).start()
    with connect(server) as s:
        s.sendall(pp.get_request(1, 0x900000, 1).encode(L))
        assert recv_exact(s, 1) == b""
    server.wait(5)
    assert src.calls == 1 and len(reasons) == 1 and "no lazy page at 0x900000" in reasons[0]


def test_a_source_that_does_not_answer_times_out() -> None:
    hang = threading.Event()
    reasons: list[str] = []
    server = PageServer(
        Source(hang=hang),
        criu_version="4.2.1",
        retries=1,
        retry_delay_s=0,
        request_timeout_s=0.2,
        on_failure=reasons.append,
    ).start()
    try:
        start = time.monotonic()
        with connect(server) as s:
            s.sendall(pp.get_request(1, 0x1000, 1).encode(L))
            assert recv_exact(s, 1) == b""
        assert time.monotonic() - start < 5
        assert len(reasons) == 1 and "no answer within 0.2 s" in reasons[0]
    finally:
        hang.set()
        server.stop()


def test_garbage_and_a_daemon_that_leaves_without_close_are_errors() -> None:
    reasons: list[str] = []
    server = PageServer(Source(), criu_version="4.2.1", on_failure=reasons.append).start()
    with connect(server) as s:
        s.sendall(b"\xff" * L.size)
        assert recv_exact(s, 1) == b""
    assert "unknown page-server command" in (server.wait(5).error or "") and len(reasons) == 1

    server = PageServer(Source(), criu_version="4.2.1").start()
    with connect(server):
        pass
    assert server.wait(5).error == "the lazy-pages daemon closed the connection without PS_IOV_CLOSE"


def test_no_daemon_connecting_is_reported() -> None:
    server = PageServer(Source(), criu_version="4.2.1", accept_timeout_s=0.1).start()
    assert "no lazy-pages daemon connected" in (server.wait(5).error or "")


def test_a_socketpair_server_answers_force_close_and_has_no_port() -> None:
    """``criu lazy-pages --ps-socket FD`` uses the socket it is given and ends with PS_IOV_FORCE_CLOSE."""
    server, theirs = PageServer.over_socketpair(Source(), criu_version="4.2.1")
    assert theirs.get_inheritable() and theirs.family == socket.AF_UNIX
    with pytest.raises(Exception, match="not a port"):
        _ = server.port
    server.start()
    with theirs:
        theirs.sendall(pp.get_request(1, 0x1000, 2).encode(L))
        assert pp.decode_iov(recv_exact(theirs, L.size), L).nr_pages == 2
        assert recv_exact(theirs, 2 * PAGE_SIZE) == page(1, 0x1000) + page(1, 0x1000 + PAGE_SIZE)
        theirs.sendall(pp.Iov(pp.PS_IOV_FORCE_CLOSE).encode(L))
        assert recv_exact(theirs, 4) == pp.close_reply(0)
    stats = server.wait(5)
    assert stats.error is None and stats.closed_at is not None and stats.pages == 2
