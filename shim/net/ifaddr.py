"""Interface addresses, through rtnetlink in-process (no `ip`).

What a restore does in a pod's network namespace: list the local addresses, lend an old pod address to
``lo`` and take it back (shim/net/podrestore.py). Call these from a thread in the namespace (shim/net/netns.py).
Bringing ``lo`` up is shim/net/loopback.py's.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

from shim.net.netlink import (
    NETLINK_ROUTE,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_EXCL,
    Netlink,
    NetlinkError,
    attr,
    parse_attrs,
)

RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFA_F_NODAD = 0x02
IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index


def local_addresses() -> set[str]:
    """Every address of every interface in this thread's network namespace (as ipaddress spells it)."""
    out: set[str] = set()
    with Netlink(NETLINK_ROUTE) as nl:
        for m in nl.dump(RTM_GETADDR, IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0), "rtnetlink: listing addresses"):
            if m.kind != RTM_NEWADDR or len(m.body) < IFADDRMSG.size:
                continue
            attrs = parse_attrs(m.body[IFADDRMSG.size :])
            raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
            if raw and len(raw) in (4, 16):
                out.add(str(ipaddress.ip_address(raw)))
    return out


def _request(kind: int, flags: int, cidr: str, device: str) -> None:
    iface = ipaddress.ip_interface(cidr)
    family = socket.AF_INET6 if iface.version == 6 else socket.AF_INET
    ifa_flags = IFA_F_NODAD if iface.version == 6 else 0
    raw = iface.ip.packed
    body = IFADDRMSG.pack(family, iface.network.prefixlen, ifa_flags, 0, socket.if_nametoindex(device))
    body += attr(IFA_LOCAL, raw) + attr(IFA_ADDRESS, raw)
    verb = "adding" if kind == RTM_NEWADDR else "removing"
    with Netlink(NETLINK_ROUTE) as nl:
        nl.transact([(kind, flags | NLM_F_ACK, body)], f"rtnetlink: {verb} {cidr} on {device}")


def add_address(cidr: str, device: str = "lo") -> bool:
    """`ip addr add CIDR dev DEVICE` (IPv6 without duplicate address detection); False if it was there."""
    try:
        _request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, cidr, device)
    except NetlinkError as e:
        if e.errno == errno.EEXIST:
            return False
        raise
    return True


def del_address(cidr: str, device: str = "lo") -> None:
    """`ip addr del CIDR dev DEVICE`."""
    _request(RTM_DELADDR, 0, cidr, device)
