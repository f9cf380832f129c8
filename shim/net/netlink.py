"""A minimal netlink client (stdlib only): messages, attributes, acknowledged requests and dumps.

What the node side asks the kernel directly instead of running a host tool: nf_tables (the pod network
locks, shim/net/nftlock.py), rtnetlink (addresses, shim/net/ifaddr.py) and sock_diag (aborting connections,
shim/net/tcpabort.py). A socket belongs to the network namespace of the thread that opened it
(shim/net/netns.py runs the work in a pod's namespace).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_ROUTE = 0
NETLINK_SOCK_DIAG = 4
NETLINK_NETFILTER = 12

NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_DUMP = 0x300
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF

HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid


class NetlinkError(OSError):
    """The kernel refused a request (errno set): ENOENT, EPERM, EOPNOTSUPP, ..."""


@dataclass(frozen=True)
class Message:
    kind: int
    flags: int
    seq: int
    body: bytes


def align(n: int) -> int:
    return (n + 3) & ~3


def attr(kind: int, payload: bytes) -> bytes:
    """One netlink attribute (type-length-value), padded to 4 bytes."""
    data = struct.pack("=HH", 4 + len(payload), kind) + payload
    return data + b"\0" * (align(len(data)) - len(data))


def attr_str(kind: int, value: str) -> bytes:
    return attr(kind, value.encode() + b"\0")


def attr_be32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("!i" if value < 0 else "!I", value))


def nested(kind: int, *attrs: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, b"".join(attrs))


def parse_attrs(data: bytes) -> dict[int, bytes]:
    """{type: payload} of the attributes in `data` (the last one wins for repeated types)."""
    out: dict[int, bytes] = {}
    off = 0
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4 or off + length > len(data):
            break
        out[kind & NLA_TYPE_MASK] = data[off + 4 : off + length]
        off += align(length)
    return out


def pack(m: Message) -> bytes:
    return HEADER.pack(HEADER.size + len(m.body), m.kind, m.flags, m.seq, 0) + m.body


def unpack(data: bytes) -> Iterator[Message]:
    off = 0
    while off + HEADER.size <= len(data):
        length, kind, flags, seq, _ = HEADER.unpack_from(data, off)
        if length < HEADER.size or off + length > len(data):
            raise ValueError("truncated netlink message")
        yield Message(kind, flags, seq, data[off + HEADER.size : off + length])
        off += align(length)


def error_code(m: Message) -> int:
    """The (positive) errno of an NLMSG_ERROR message; 0 for an acknowledgement."""
    (code,) = struct.unpack_from("=i", m.body)
    return -int(code)


def fail(code: int, what: str) -> NetlinkError:
    return NetlinkError(code, f"{what}: {os.strerror(code)}")


class Netlink:
    """A netlink socket of one protocol in the calling thread's network namespace."""

    def __init__(self, protocol: int, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, protocol)
        self.sock.settimeout(timeout)
        self.sock.bind((0, 0))
        self._seq = 0

    def __enter__(self) -> Netlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def seq(self) -> int:
        self._seq += 1
        return self._seq

    def _read(self) -> Iterator[Message]:
        yield from unpack(self.sock.recv(1 << 20))

    def transact(self, messages: list[tuple[int, int, bytes]], what: str) -> None:
        """Send `messages` ((type, flags, body)) in one write; every one flagged NLM_F_ACK must be
        acknowledged. Raises NetlinkError with the first error the kernel reports."""
        msgs = [Message(kind, flags | NLM_F_REQUEST, self.seq(), body) for kind, flags, body in messages]
        self.sock.send(b"".join(pack(m) for m in msgs))
        waiting = {m.seq for m in msgs if m.flags & NLM_F_ACK}
        ours = {m.seq for m in msgs}
        while waiting:
            for m in self._read():
                if m.kind != NLMSG_ERROR or m.seq not in ours:
                    continue
                code = error_code(m)
                if code:
                    raise fail(code, what)
                waiting.discard(m.seq)

    def dump(self, kind: int, body: bytes, what: str) -> list[Message]:
        """A dump request: every answer message until NLMSG_DONE."""
        seq = self.seq()
        self.sock.send(pack(Message(kind, NLM_F_REQUEST | NLM_F_DUMP, seq, body)))
        out: list[Message] = []
        while True:
            for m in self._read():
                if m.seq != seq:
                    continue
                if m.kind == NLMSG_DONE:
                    return out
                if m.kind == NLMSG_ERROR:
                    code = error_code(m)
                    if code:
                        raise fail(code, what)
                    continue
                out.append(m)


def is_missing(e: OSError) -> bool:
    return e.errno in (errno.ENOENT, errno.ESRCH, errno.EADDRNOTAVAIL)
