"""A loopback HTTP proxy in front of a real registry that fails on purpose.

``FaultyProxy(upstream_host, upstream_port, fail_after_bytes=N)`` forwards requests but, once N
request-body bytes have passed through it (counted over its lifetime), resets the connection in
the middle of the request that crosses N. ``fail_on=(method, path_regex)`` answers ``status``
(with a distribution error body, optional Retry-After and ``fail_headers``) instead of forwarding.
``corrupt_on=(method, path_regex)`` flips one byte of the matching responses' bodies.
``redirect_on=(method, path_regex)`` answers 307 to the same path on the upstream (as registries
with object-storage backends do), or to ``redirect_to`` (host, port) when given. ``swallow_on=(method,
path_regex)`` answers 201 Created (with the Docker-Content-Digest and Location a registry gives) and
forwards nothing: a blob upload's last PUT or a manifest's PUT acknowledged and never stored.
``hold_on=(method, path_regex)`` reads the matching request and holds it, never forwarding it:
``.holding`` is set once one is held; ``release()`` ends the held requests with a reset (a client killed
meanwhile has gone already). ``times`` bounds how many failures are injected (None: every time).
``.requests`` records (method, path, status) for every request, status 0 for a reset; ``.authorized``
the (method, path) of those that carried an Authorization header. Use as a context manager.

The registry builds Location headers from the Host header, which the proxy forwards unchanged,
so upload sessions keep going through the proxy.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import re
import socket
import struct
import threading
from types import TracebackType
from typing import Any

PIECE = 1 << 16


class FaultyProxy:
    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        fail_after_bytes: int | None = None,
        fail_on: tuple[str, str] | None = None,
        status: int = 500,
        retry_after: int | None = None,
        fail_headers: dict[str, str] | None = None,
        corrupt_on: tuple[str, str] | None = None,
        redirect_on: tuple[str, str] | None = None,
        redirect_to: tuple[str, int] | None = None,
        swallow_on: tuple[str, str] | None = None,
        times: int | None = None,
        hold_on: tuple[str, str] | None = None,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.fail_after_bytes = fail_after_bytes
        self.fail_on = (fail_on[0].upper(), re.compile(fail_on[1])) if fail_on else None
        self.corrupt_on = (corrupt_on[0].upper(), re.compile(corrupt_on[1])) if corrupt_on else None
        self.redirect_on = (redirect_on[0].upper(), re.compile(redirect_on[1])) if redirect_on else None
        self.redirect_to = redirect_to or (upstream_host, upstream_port)
        self.swallow_on = (swallow_on[0].upper(), re.compile(swallow_on[1])) if swallow_on else None
        self.hold_on = (hold_on[0].upper(), re.compile(hold_on[1])) if hold_on else None
        self.holding = threading.Event()
        self._released = threading.Event()
        self.authorized: list[tuple[str, str]] = []
        self.status = status
        self.retry_after = retry_after
        self.fail_headers = dict(fail_headers or {})
        self.times = times
        self.failures = 0
        self.body_bytes = 0
        self.requests: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.host = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> FaultyProxy:
        self._thread.start()
        return self

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultyProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _may_fail(self) -> bool:
        with self._lock:
            if self.times is not None and self.failures >= self.times:
                return False
            self.failures += 1
            return True

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reset(self) -> None:
                # RST instead of FIN: the client sees "connection reset", like a crashed registry
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return bytes(data)
                        data += self.rfile.read(size)
                        self.rfile.readline()
                return b""

            def _handle(self) -> None:
                method, path = self.command, self.path
                if self.headers.get("Authorization"):
                    with proxy._lock:
                        proxy.authorized.append((method, path))
                matches = bool(proxy.fail_on and proxy.fail_on[0] in (method, "*") and proxy.fail_on[1].search(path))
                if matches and proxy._may_fail():
                    self._fail(method, path)
                    return
                swallow = proxy.swallow_on
                if swallow and swallow[0] in (method, "*") and swallow[1].search(path) and proxy._may_fail():
                    self._swallow(method, path)
                    return
                hold = proxy.hold_on
                if hold and hold[0] in (method, "*") and hold[1].search(path):
                    self._hold(method, path)
                    return
                redirect = proxy.redirect_on
                if redirect and redirect[0] in (method, "*") and redirect[1].search(path):
                    proxy._record(method, path, 307)
                    self.send_response(307)
                    self.send_header("Location", f"http://{proxy.redirect_to[0]}:{proxy.redirect_to[1]}{path}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                length = int(self.headers.get("Content-Length", "0") or 0)
                chunked_body = self._read_body()
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                    for key, value in self.headers.items():
                        if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                            upstream.putheader(key, value)
                    upstream.putheader("Content-Length", str(length or len(chunked_body)))
                    upstream.putheader("Connection", "close")
                    upstream.endheaders()
                    if chunked_body:
                        upstream.send(chunked_body)
                    remaining = length
                    while remaining > 0:
                        piece = self.rfile.read(min(PIECE, remaining))
                        if not piece:
                            break
                        remaining -= len(piece)
                        with proxy._lock:
                            before = proxy.body_bytes
                            proxy.body_bytes += len(piece)
                            crossing = (
                                proxy.fail_after_bytes is not None
                                and before < proxy.fail_after_bytes <= proxy.body_bytes
                            )
                            if proxy.fail_after_bytes is not None and before >= proxy.fail_after_bytes:
                                crossing = True  # already past the limit: every further body fails
                        if crossing and proxy._may_fail():
                            proxy._record(method, path, 0)
                            self._reset()
                            return
                        upstream.send(piece)
                    resp = upstream.getresponse()
                    body = resp.read()
                    if (
                        proxy.corrupt_on
                        and body
                        and proxy.corrupt_on[0] in (method, "*")
                        and proxy.corrupt_on[1].search(path)
                        and proxy._may_fail()
                    ):
                        body = bytes([body[0] ^ 0xFF]) + body[1:]
                    self.send_response_only(resp.status, resp.reason)
                    for key, value in resp.getheaders():
                        if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                            self.send_header(key, value)
                    declared = resp.getheader("Content-Length")
                    self.send_header("Content-Length", declared if method == "HEAD" and declared else str(len(body)))
                    self.end_headers()
                    proxy._record(method, path, resp.status)  # before the client can see the answer
                    if method != "HEAD":
                        self.wfile.write(body)
                finally:
                    upstream.close()

            def _swallow(self, method: str, path: str) -> None:
                body = self._read_body() or self.rfile.read(int(self.headers.get("Content-Length", "0") or 0))
                query = re.search(r"[?&]digest=([^&]+)", path)
                if query:  # the last PUT of a blob upload: /v2/REPO/blobs/uploads/ID?digest=D
                    digest = query.group(1).replace("%3A", ":")
                    location = path.split("/blobs/uploads/")[0] + f"/blobs/{digest}"
                else:  # a manifest
                    digest, location = "sha256:" + hashlib.sha256(body).hexdigest(), path
                proxy._record(method, path, 201)
                self.send_response(201)
                self.send_header("Docker-Content-Digest", digest)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _hold(self, method: str, path: str) -> None:
                self._drain()
                proxy._record(method, path, 0)
                proxy.holding.set()
                proxy._released.wait(300)
                self._reset()

            def _drain(self) -> None:
                self._read_body()
                length = int(self.headers.get("Content-Length", "0") or 0)
                while length > 0:
                    got = self.rfile.read(min(PIECE, length))
                    if not got:
                        break
                    length -= len(got)

            def _fail(self, method: str, path: str) -> None:
                self._drain()
                payload = json.dumps(
                    {"errors": [{"code": "UNAVAILABLE", "message": f"injected failure {proxy.status}"}]}
                ).encode()
                proxy._record(method, path, proxy.status)
                self.send_response(proxy.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "0" if method == "HEAD" else str(len(payload)))
                if proxy.retry_after is not None:
                    self.send_header("Retry-After", str(proxy.retry_after))
                for key, value in proxy.fail_headers.items():
                    self.send_header(key, value)
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        return Handler
