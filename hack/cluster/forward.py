#!/usr/bin/env python3
"""Relay TCP connections across network namespaces through a Unix socket (stdlib only).

Why: the test cluster lives in its own network namespace (so its node and API server addresses
are real, non-loopback addresses that the API server's node proxy accepts, without putting any
address on the root namespace's interfaces). Users and tests in the root namespace reach the API
server and the registry at 127.0.0.1 through two relays joined by a Unix socket, which belongs to
the filesystem, not to a network namespace:

  root ns:     forward.py tcp:127.0.0.1:6443  unix:/run/ks-cluster/fwd/apiserver.sock
  cluster ns:  forward.py unix:/run/ks-cluster/fwd/apiserver.sock  tcp:127.0.0.1:6443

Usage: forward.py LISTEN TARGET   (each tcp:HOST:PORT or unix:PATH)
"""

from __future__ import annotations

import asyncio
import os
import sys

CHUNK = 256 * 1024


async def _open(spec: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    kind, _, rest = spec.partition(":")
    if kind == "unix":
        return await asyncio.open_unix_connection(rest, limit=CHUNK)
    host, _, port = rest.rpartition(":")
    return await asyncio.open_connection(host, int(port), limit=CHUNK)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()


async def _serve(listen: str, target: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await _open(target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, t_writer), _pipe(t_reader, writer), return_exceptions=True)
        for w in (writer, t_writer):
            w.close()

    kind, _, rest = listen.partition(":")
    if kind == "unix":
        if os.path.exists(rest):
            os.unlink(rest)
        server = await asyncio.start_unix_server(handle, rest, limit=CHUNK)
    else:
        host, _, port = rest.rpartition(":")
        server = await asyncio.start_server(handle, host, int(port), limit=CHUNK, reuse_address=True)
    print(f"listening on {listen}, forwarding to {target}", flush=True)  # up.sh waits for this line
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(_serve(argv[0], argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
