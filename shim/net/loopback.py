"""`ip link set lo up`, in-process: an ioctl on a datagram socket of the calling thread's network
namespace (call it from a thread in the namespace: shim/net/netns.py).

The runtime wrapper brings a restored container's own ``lo`` up with this (shim/runtime_wrapper.py) on its way
to containerd's start, so it imports only what the hook has imported already: ``_socket``, not
socket.py, which builds its enums of every address family and socket type at import.
"""

from __future__ import annotations

import _socket
import fcntl
import struct

SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1
IFREQ = struct.Struct("16sH22x")  # struct ifreq: the name, then ifr_flags


def loopback_up() -> None:
    """`ip link set lo up` in this thread's network namespace."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        _, flags = IFREQ.unpack(fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, IFREQ.pack(b"lo", 0)))
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, IFREQ.pack(b"lo", flags | IFF_UP))
    finally:
        s.close()
