"""Abort TCP connections whose local end is not loopback: `ss -K`, through sock_diag in-process.

After a pod is restored on another node, its connections that left the pod still have the old pod
address as their local end; the restore aborts them (as if a reset had come) so that the application
sees ECONNABORTED at once and reconnects (shim/net/podrestore.py). The kernel does it for a
``SOCK_DESTROY`` request naming the socket (family, addresses, ports, interface, cookie, as a
``SOCK_DIAG_BY_FAMILY`` dump lists them); it needs ``CONFIG_INET_DIAG_DESTROY`` (doctor probes it:
shim/service/nodecheck.py). Call it from a thread in the namespace (shim/net/netns.py).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from dataclasses import dataclass

from shim.net.netlink import NETLINK_SOCK_DIAG, NLM_F_ACK, Netlink, NetlinkError

SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
REQ = struct.Struct("=BBBxI")  # inet_diag_req_v2 before its inet_diag_sockid: family, protocol, ext, pad, states
SOCKID_SIZE = 48  # sport, dport (be16), src[16], dst[16], if (u32), cookie (2 x u32)
MSG = struct.Struct("=BBBB")  # inet_diag_msg before its sockid: family, state, timer, retrans
# TCP states `ss state connected` means: all but LISTEN, CLOSE, TIME_WAIT and SYN_RECV
ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING = 1, 2, 4, 5, 8, 9, 11
CONNECTED = sum(1 << s for s in (ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING))


@dataclass(frozen=True)
class Connection:
    family: int
    local: str
    local_port: int
    remote: str
    remote_port: int
    sockid: bytes  # as the kernel listed it: what SOCK_DESTROY needs back


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def _request(family: int, states: int, sockid: bytes = b"\0" * SOCKID_SIZE) -> bytes:
    return REQ.pack(family, socket.IPPROTO_TCP, 0, states) + sockid


def parse(body: bytes) -> Connection | None:
    if len(body) < MSG.size + SOCKID_SIZE:
        return None
    family = body[0]
    sockid = body[MSG.size : MSG.size + SOCKID_SIZE]
    sport, dport = struct.unpack_from("!HH", sockid)
    size = 4 if family == socket.AF_INET else 16
    src, dst = sockid[4 : 4 + size], sockid[20 : 20 + size]
    return Connection(family, str(ipaddress.ip_address(src)), sport, str(ipaddress.ip_address(dst)), dport, sockid)


def connections() -> list[Connection]:
    """The connected TCP sockets (IPv4 and IPv6) of this thread's network namespace."""
    out: list[Connection] = []
    with Netlink(NETLINK_SOCK_DIAG) as nl:
        for family in (socket.AF_INET, socket.AF_INET6):
            for m in nl.dump(SOCK_DIAG_BY_FAMILY, _request(family, CONNECTED), "sock_diag: listing TCP sockets"):
                c = parse(m.body) if m.kind == SOCK_DIAG_BY_FAMILY else None
                if c is not None:
                    out.append(c)
    return out


def destroy(nl: Netlink, c: Connection) -> bool:
    """Abort one connection; False when it is gone already."""
    try:
        nl.transact(
            [(SOCK_DESTROY, NLM_F_ACK, _request(c.family, 0xFFFFFFFF, c.sockid))],
            f"sock_diag: aborting {c.local}:{c.local_port} -> {c.remote}:{c.remote_port}",
        )
    except NetlinkError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def abort_external() -> list[Connection]:
    """Abort every connected TCP socket whose local address is not loopback; returns those aborted."""
    aborted = []
    with Netlink(NETLINK_SOCK_DIAG) as nl:
        for c in connections():
            if not is_loopback(c.local) and destroy(nl, c):
                aborted.append(c)
    return aborted


def probe() -> str:
    """ "" when this kernel can abort sockets through sock_diag, else why not (harmless: names no socket)."""
    nobody = Connection(socket.AF_INET, "0.0.0.0", 0, "0.0.0.0", 0, b"\0" * SOCKID_SIZE)
    try:
        with Netlink(NETLINK_SOCK_DIAG) as nl:
            destroy(nl, nobody)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            return "the kernel cannot abort sockets (CONFIG_INET_DIAG_DESTROY is off)"
        return f"sock_diag is not usable here: {e}"
    return ""
