"""Finding Unix socket connections between containers (shim.net.unixpeers): the netlink parsing over
crafted messages, the matching, and one real dump of this process's own namespace."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from shim.net import unixpeers as U


def _msg(ino: int, stype: int, peer: int = 0, name: bytes = b"") -> bytes:
    attrs = b""
    if name:
        attrs += struct.pack("=HH", 4 + len(name), U.UNIX_DIAG_NAME) + name + b"\0" * (-len(name) % 4)
    if peer:
        attrs += struct.pack("=HHI", 8, U.UNIX_DIAG_PEER, peer)
    body = struct.pack("=BBBBI2I", socket.AF_UNIX, stype, 1, 0, ino, 0, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), U.SOCK_DIAG_BY_FAMILY, 2, 1, 0) + body


def _done() -> bytes:
    return struct.pack("=IHHIIi", 20, U.NLMSG_DONE, 2, 1, 0, 0)


def test_parse_reads_inode_peer_type_and_name() -> None:
    data = _msg(11, socket.SOCK_STREAM, peer=12, name=b"/vol/sock") + _msg(12, socket.SOCK_STREAM, peer=11)
    data += _msg(13, socket.SOCK_DGRAM, name=b"\0abstract")
    found, done = U.parse(data)
    assert not done
    assert found == [
        U.UnixSocket(11, 12, socket.SOCK_STREAM, "/vol/sock"),
        U.UnixSocket(12, 11, socket.SOCK_STREAM, ""),
        U.UnixSocket(13, 0, socket.SOCK_DGRAM, "@abstract"),
    ]
    assert U.parse(_done()) == ([], True)


def test_parse_refuses_truncated_messages_and_reports_errors() -> None:
    with pytest.raises(ValueError):
        U.parse(_msg(1, socket.SOCK_STREAM) + _cut())
    err = struct.pack("=IHHIIi", 20, U.NLMSG_ERROR, 0, 1, 0, -13)
    with pytest.raises(OSError, match="Permission denied"):
        U.parse(err)


def _cut() -> bytes:
    return struct.pack("=IHHII", 64, U.SOCK_DIAG_BY_FAMILY, 2, 1, 0)  # says 64 bytes, has 16


def test_cross_links_only_between_two_containers() -> None:
    sockets = [
        U.UnixSocket(1, 2, socket.SOCK_STREAM, "/vol/sock"),  # server's accepted end
        U.UnixSocket(2, 1, socket.SOCK_STREAM, ""),  # client's end
        U.UnixSocket(3, 4, socket.SOCK_STREAM, ""),  # a socketpair inside the server
        U.UnixSocket(4, 3, socket.SOCK_STREAM, ""),
        U.UnixSocket(5, 0, socket.SOCK_STREAM, "/vol/sock"),  # listening
        U.UnixSocket(6, 99, socket.SOCK_DGRAM, ""),  # peer held by no container of the group
    ]
    links = U.cross_links(sockets, [{1, 3, 4, 5}, {2, 6}])
    assert links == [U.CrossLink(0, 1, "stream", "/vol/sock")]
    assert U.cross_links(sockets, [{1, 2, 3, 4, 5, 6}]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="joining a network namespace needs CAP_SYS_ADMIN")
def test_a_real_socketpair_between_two_processes_is_found() -> None:
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the "other container": holds one end
        a.close()
        time.sleep(30)
        os._exit(0)
    b.close()
    try:
        sockets = U.sockets_in_netns_of(os.getpid())
        mine, theirs = U.socket_inodes([os.getpid()]), U.socket_inodes([pid])
        assert os.fstat(a.fileno()).st_ino in mine
        assert U.cross_links(sockets, [mine, theirs]) == [U.CrossLink(0, 1, "stream", "")]
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        a.close()
