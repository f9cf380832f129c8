"""The pod network lock (shim/net/nftlock.py) in a real network namespace, made here with `ip netns`: every
packet of the namespace is dropped while it stands, except the ones CRIU itself sends while it restores
TCP connections (marked SOCCR_MARK: the FIN of a connection caught half-closed). Without that exception
the restore of a pod whose HTTP probe's connection was closing at the dump failed ("Unable to send a fin
packet ... Operation not permitted"), which the conformance case node-probes-restore met.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from shim.net import netns, nftlock

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and ip(8)"),
]


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"ks-nftlock-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield f"/var/run/netns/{name}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _send(mark: int) -> str:
    """One UDP datagram to the namespace's own loopback: "sent", or the errno's name."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        if mark:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        try:
            s.sendto(b"x", ("127.0.0.1", 9))
        except OSError as e:
            return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "sent"


def test_the_lock_drops_every_packet_but_criu_own_and_lifting_it_lets_all_through(namespace: str) -> None:
    def work() -> dict[str, str]:
        seen = {"before": _send(0)}
        nftlock.lock("ks-test-lock")
        try:
            seen |= {"locked": _send(0), "criu": _send(nftlock.SOCCR_MARK), "other mark": _send(0x1234)}
            nftlock.lock("ks-test-lock")  # taken again (idempotent): the same
            seen["criu again"] = _send(nftlock.SOCCR_MARK)
        finally:
            nftlock.unlock("ks-test-lock")
        seen["after"] = _send(0)
        return seen

    assert netns.run_in(namespace, work) == {
        "before": "sent",
        "locked": "EPERM",
        "criu": "sent",  # CRIU's own packet, as CRIU's own lock lets it pass
        "other mark": "EPERM",
        "criu again": "sent",
        "after": "sent",
    }
