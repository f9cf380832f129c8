"""Which old pod addresses a container's CRIU images need lent back (shim.criu.oldaddrs), from files.img
entries as pycriu decodes them. Real images of a connection that left the pod are restored in
tests/e2e/test_whole_pod.py (the "away" container)."""

from __future__ import annotations

import socket
import struct
from typing import Any

from shim.criu.oldaddrs import connected_sources


def _v4(text: str) -> list[int]:
    return [struct.unpack("<I", socket.inet_aton(text))[0]]


def _v6(text: str) -> list[int]:
    return list(struct.unpack("<4I", socket.inet_pton(socket.AF_INET6, text)))


def _isk(family: int, src: Any, dst_port: int = 7001) -> dict[str, Any]:
    return {"type": "INETSK", "isk": {"family": family, "proto": 6, "state": 1, "src_addr": src, "dst_port": dst_port}}


def test_connected_sockets_from_non_local_addresses_are_listed_once() -> None:
    entries = [
        _isk(2, _v4("10.244.0.3")),  # the connection that left the pod (as 4.2.1's pycriu decodes it)
        _isk(2, _v4("10.244.0.3"), dst_port=443),
        _isk(2, _v4("127.0.0.1")),  # loopback: local everywhere
        _isk(2, _v4("0.0.0.0"), dst_port=0),  # a listener
        _isk(2, _v4("10.244.0.3"), dst_port=0),  # a listener bound to the old address: bind needs no route
        _isk(10, _v6("::ffff:10.244.0.4")),  # a dual-stack socket's IPv4 connection
        _isk(10, _v6("::1")),
        _isk(10, ["fd00::5"]),  # pycriu versions that decode addresses to text
        _isk(10, _v6("fe80::1")),
        {"type": "UNIXSK", "usk": {"dst_port": 1}},
        {"type": "INETSK", "isk": {"family": 2, "src_addr": [1, 2], "dst_port": 1}},  # malformed: skipped
    ]
    assert connected_sources(entries) == ["10.244.0.3", "10.244.0.4", "fd00::5"]


def test_no_sockets_nothing_to_lend() -> None:
    assert connected_sources([]) == []
