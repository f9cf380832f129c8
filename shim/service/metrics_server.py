"""Serve the agent's metrics over HTTPS to the scrapers the API server authorises (shim/service/metrics_auth.py).

The certificate is self-signed, made at start-up (scrapers use ``insecure_skip_verify`` or pin it, as
with controller-runtime's default). The accept loop only accepts: each connection's TLS handshake,
request and answer happen in a thread of its own, at most `MAX_CONNECTIONS` at once (more are closed
as they arrive), within `DEADLINE_S` all told (a watchdog cuts the connection then), so a client that
connects and sends nothing, or sends slowly, holds one slot for a while and never the server.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shim.service.metrics_auth import DEFAULT_AUDIENCES, METRICS_PATH, Authorizer, Decision, ReviewApi

log = logging.getLogger(__name__)
DEADLINE_S = 10.0  # handshake, request and answer of one connection: a scrape takes milliseconds
MAX_CONNECTIONS = 16

__all__ = [
    "DEFAULT_AUDIENCES",
    "METRICS_PATH",
    "Authorizer",
    "Decision",
    "ReviewApi",
    "TlsServer",
    "self_signed",
    "serve",
]


def self_signed(names: list[str], directory: str) -> tuple[str, str]:
    """An EC P-256 certificate for `names` (DNS names or IPs), valid a year; returns (cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from kubectl_snapshot.core.servingcert import subject_alt_names

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "kubectl-snapshot-agent")])
    sans = subject_alt_names(names)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(key, hashes.SHA256())
    cert_path, key_path = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


class TlsServer(ThreadingHTTPServer):
    """HTTPS with each connection's handshake and request in a bounded set of threads under one deadline
    (the key broker serves through it too)."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: Any, tls: ssl.SSLContext, *, deadline_s: float, max_connections: int
    ) -> None:
        self.tls, self.deadline_s = tls, deadline_s
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # all busy: close it now, do not queue it
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's thread: the handshake, then the request, under one deadline."""
        conn = self.tls.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        conn.settimeout(self.deadline_s)
        # shutdown(2) on the descriptor (the plain socket's method: no TLS close_notify from this
        # thread) wakes whatever read or write the connection's thread is blocked in
        watchdog = threading.Timer(self.deadline_s, _cut, (conn,))
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.do_handshake()
            super().finish_request(conn, client_address)
        except (OSError, ValueError) as e:  # a client that went away or never spoke TLS
            log.debug("metrics: connection from %s: %s", client_address, e)
        finally:
            watchdog.cancel()
            conn.close()


def _cut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed already
        socket.socket.shutdown(conn, socket.SHUT_RDWR)


def serve(
    registry: CollectorRegistry,
    authorizer: Authorizer,
    *,
    host: str,
    port: int,
    names: list[str],
    deadline_s: float = DEADLINE_S,
    max_connections: int = MAX_CONNECTIONS,
) -> ThreadingHTTPServer:
    """Start the HTTPS server in a daemon thread; returns it (``.shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != METRICS_PATH:
                self._reply(404, b"not found\n")
                return
            decision = authorizer.check(self.headers.get("Authorization"))
            if decision.code != 200:
                self._reply(decision.code, _REFUSALS.get(decision.code, b"refused\n"))
                return
            self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            if code == 429:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics: " + format, *args)

    tls_dir = tempfile.mkdtemp(prefix="ks-metrics-tls-")
    cert, key = self_signed(names, tls_dir)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    for p in (cert, key):
        os.unlink(p)  # loaded: nothing of the key stays on disk
    os.rmdir(tls_dir)
    server = TlsServer((host, port), Handler, ctx, deadline_s=deadline_s, max_connections=max_connections)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


_REFUSALS = {401: b"unauthorized\n", 403: b"forbidden\n", 429: b"too many new tokens, retry\n"}


def audiences_of(value: str) -> Sequence[str]:
    """`--metrics-token-audiences`: comma-separated; empty: the API server's own."""
    return tuple(a.strip() for a in value.split(",") if a.strip())
