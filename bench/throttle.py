"""A registry behind a link of limited bandwidth, on loopback: a TCP proxy (bench/run.py --link-mbps).

Every byte between the clients and the registry crosses one shared link per direction, which passes
at most `mbps` megabits per second (each 64 KiB piece waits for its turn on the link; no delay added
per round trip). The registry of a real node is across a network, not on the node's own two cores:
this shows what a restore or a save does while the bytes are on their way.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

PIECE = 64 << 10


class _Direction:
    """One direction of the link: pieces leave one after another at the link's rate."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.lock = threading.Lock()
        self.free_at = 0.0

    def wait(self, n: int) -> None:
        with self.lock:
            start = max(time.monotonic(), self.free_at)
            self.free_at = start + n / self.rate
            done = self.free_at
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class ThrottledLink:
    """`host` (127.0.0.1:PORT) reaches `target` (HOST:PORT) through the limited link."""

    def __init__(self, target: str, mbps: float) -> None:
        addr, _, port = target.rpartition(":")
        self.target = (addr, int(port))
        self.up, self.down = _Direction(mbps * 1e6 / 8), _Direction(mbps * 1e6 / 8)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.closed = threading.Event()
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for src, dst, way in ((client, server, self.up), (server, client, self.down)):
                threading.Thread(target=self._pipe, args=(src, dst, way), name="link", daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, way: _Direction) -> None:
        try:
            while data := src.recv(PIECE):
                way.wait(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


class LinkedRegistry:
    """The bench's registry as its clients see it: its `host` is the link's; the rest is the registry's."""

    def __init__(self, registry: Any, link: ThrottledLink) -> None:
        self._registry = registry
        self.host = link.host
        self.url = f"http://{link.host}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)
