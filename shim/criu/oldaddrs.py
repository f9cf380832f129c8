"""The old pod addresses a container's connected sockets were bound to, read from its CRIU images.

CRIU restores an established TCP connection (and a connected UDP socket) by binding it to its old
local address and calling ``connect`` in repair mode. The kernel's route lookup for that ``connect``
refuses a source address that is not local to the namespace (ENETUNREACH, CRIU: "Can't connect inet
socket back: Network is unreachable"). A connection that left the pod was made from the old pod IP,
which the new pod does not have; the whole-pod restore lends it for the restore
(shim/net/podrestore.py). Loopback and wildcard addresses are local everywhere and are not listed.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shim.criu.guard import ImageReader

_FAMILIES = {int(socket.AF_INET): 4, int(socket.AF_INET6): 6, "INET": 4, "INET6": 6}


def _address(words: Any, version: int) -> str | None:
    """An address as CRIU stores it (uint32 words in network byte order, or pycriu's text)."""
    if isinstance(words, list) and len(words) == 1 and isinstance(words[0], str):
        words = words[0]
    if isinstance(words, str):
        try:
            return str(ipaddress.ip_address(words))
        except ValueError:
            return None
    if not isinstance(words, list) or len(words) != (1 if version == 4 else 4):
        return None
    try:
        raw = b"".join(struct.pack("<I", int(w)) for w in words)
    except (TypeError, ValueError, struct.error):
        return None
    return str(ipaddress.ip_address(raw))


def connected_sources(entries: Iterable[Mapping[str, Any]]) -> list[str]:
    """Non-local-anywhere source addresses of the connected inet sockets among files.img entries."""
    found: set[str] = set()
    for entry in entries:
        isk = entry.get("isk") if entry.get("type") == "INETSK" else None
        if not isinstance(isk, Mapping) or not isk.get("dst_port"):
            continue
        version = _FAMILIES.get(isk.get("family"))
        if version is None:
            continue
        text = _address(isk.get("src_addr"), version)
        if text is None:
            continue
        addr = ipaddress.ip_address(text)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # a dual-stack socket's IPv4 connection
        if not (addr.is_loopback or addr.is_unspecified or addr.is_multicast or addr.is_link_local):
            found.add(str(addr))
    return sorted(found)


def old_sources(image_dir: str, reader: ImageReader | None = None) -> list[str]:
    """connected_sources of a checkpoint directory's files.img ([] when there is none)."""
    from shim.criu.guard import ImageReader

    path = os.path.join(image_dir, "files.img")
    if not os.path.exists(path):
        return []
    return connected_sources((reader or ImageReader()).load(path))
