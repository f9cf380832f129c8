"""Unix socket connections between the containers of one snapshot, found before anything is frozen.

CRIU dumps each container separately (one ``runc checkpoint`` per container, through containerd). A
Unix socket whose peer is in another container is "external" to that dump, and CRIU can only handle
external peers it can reconnect by name on restore: datagram sockets, with ``--ext-unix-sk``. One end
of a *stream* connection ("Can't dump half of stream unix connection") can only be restored from a
socket handed to CRIU with ``--external unix[<ino>]`` at dump and ``--inherit-fd`` at restore, which
neither containerd's checkpoint API nor ``runc restore`` lets a caller pass. So kubectl-snapshot
refuses such a pod up front, with the containers and the socket named, instead of freezing it and
failing in CRIU (docs/kubernetes.md).

The connections are found with the kernel's sock_diag (NETLINK_SOCK_DIAG, ``UNIX_DIAG_PEER``) in the
pod's network namespace (Unix sockets belong to one), from a short-lived thread that joins that
namespace alone, and matched to the containers through the socket inodes in ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from shim.net import netns

log = logging.getLogger(__name__)
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
UDIAG_SHOW_NAME = 0x1
UDIAG_SHOW_PEER = 0x4
UNIX_DIAG_NAME = 0
UNIX_DIAG_PEER = 2
_NLMSGHDR = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBHIII2I")
_MSG = struct.Struct("=BBBBI2I")
_RTA = struct.Struct("=HH")
TYPES: dict[int, str] = {
    int(socket.SOCK_STREAM): "stream",
    int(socket.SOCK_DGRAM): "datagram",
    int(socket.SOCK_SEQPACKET): "seqpacket",
}


@dataclass(frozen=True)
class UnixSocket:
    ino: int
    peer: int  # 0: not connected
    type: int
    name: str  # "" unnamed, "@..." abstract


def request(seq: int = 1) -> bytes:
    body = _REQ.pack(socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, UDIAG_SHOW_NAME | UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF)
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def parse(data: bytes) -> tuple[list[UnixSocket], bool]:
    """The sockets in one netlink read, and whether the dump is done."""
    out: list[UnixSocket] = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            raise ValueError("truncated netlink message")
        if kind == NLMSG_DONE:
            return out, True
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, off + _NLMSGHDR.size)
            raise OSError(-code, f"sock_diag: {os.strerror(-code)}")
        if kind == SOCK_DIAG_BY_FAMILY and length >= _NLMSGHDR.size + _MSG.size:
            _, stype, _, _, ino, _, _ = _MSG.unpack_from(data, off + _NLMSGHDR.size)
            peer, name = 0, ""
            a = off + _NLMSGHDR.size + _MSG.size
            while a + _RTA.size <= off + length:
                alen, atype = _RTA.unpack_from(data, a)
                if alen < _RTA.size:
                    break
                payload = data[a + _RTA.size : a + alen]
                if atype == UNIX_DIAG_PEER and len(payload) >= 4:
                    (peer,) = struct.unpack_from("=I", payload)
                elif atype == UNIX_DIAG_NAME and payload:
                    if payload[:1] == b"\0":  # abstract
                        name = "@" + payload[1:].decode(errors="replace")
                    else:
                        name = payload.rstrip(b"\0").decode(errors="replace")
                a += (alen + 3) & ~3
            out.append(UnixSocket(ino, peer, stype, name))
        off += (length + 3) & ~3
    return out, False


def _dump_here() -> list[UnixSocket]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
        s.settimeout(5)
        s.sendto(request(), (0, 0))
        found: list[UnixSocket] = []
        while True:
            chunk, done = parse(s.recv(1 << 20))
            found.extend(chunk)
            if done:
                return found


def sockets_in_netns_of(pid: int) -> list[UnixSocket]:
    """Every Unix socket of the network namespace process `pid` is in (a thread joins it, then ends)."""
    return netns.run_in(f"/proc/{pid}/ns/net", _dump_here, timeout=10)


def _cgroup(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return None


def container_pids(init_pid: int) -> list[int]:
    """The processes in the cgroup of a container's init process (all of the container's)."""
    mine = _cgroup(init_pid)
    if mine is None:
        return [init_pid]
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _cgroup(int(entry)) == mine:
            pids.append(int(entry))
    return pids or [init_pid]


def socket_inodes(pids: Sequence[int]) -> set[int]:
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link.endswith("]"):
                        inodes.add(int(link[8:-1]))
    return inodes


@dataclass(frozen=True)
class CrossLink:
    a: int  # index of a container in the group
    b: int
    kind: str  # "stream", "datagram", ...
    name: str  # the bound path of either end, if any


def cross_links(sockets: Sequence[UnixSocket], owners: Sequence[set[int]]) -> list[CrossLink]:
    """Unix connections whose two ends are held by two different containers (pure)."""
    by_ino = {s.ino: s for s in sockets}
    owner: dict[int, int] = {}
    for i, inodes in enumerate(owners):
        for ino in inodes:
            owner.setdefault(ino, i)
    links: dict[tuple[int, ...], CrossLink] = {}
    for s in sockets:
        if not s.peer or s.ino not in owner or s.peer not in owner or owner[s.ino] == owner[s.peer]:
            continue
        a, b = sorted((owner[s.ino], owner[s.peer]))
        key = (a, b, *sorted((s.ino, s.peer)))
        peer = by_ino.get(s.peer)
        links.setdefault(key, CrossLink(a, b, TYPES.get(s.type, str(s.type)), s.name or (peer.name if peer else "")))
    return sorted(links.values(), key=lambda x: (x.a, x.b, x.name))


def find_cross_links(init_pids: Sequence[int]) -> list[CrossLink]:
    """Unix connections between the containers whose init processes are `init_pids` (host pids)."""
    if len(init_pids) < 2:
        return []
    owners = [socket_inodes(container_pids(p)) for p in init_pids]
    sockets: dict[int, UnixSocket] = {}
    seen_ns: set[str] = set()
    for pid in init_pids:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        try:
            found = sockets_in_netns_of(pid)
        except (OSError, ValueError) as e:
            # Not knowing never blocks a snapshot: CRIU still refuses such a socket, later, itself.
            log.warning("could not list the Unix sockets of pid %d's network namespace: %s", pid, e)
            return []
        for s in found:
            sockets[s.ino] = s
    return cross_links(list(sockets.values()), owners)
