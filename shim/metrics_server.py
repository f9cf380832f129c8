"""Serve the agent's metrics over HTTPS to authenticated, authorised scrapers only.

As controller-runtime's secure metrics serving does: the scraper presents a bearer token; the API
server says who it is (TokenReview) and whether that identity may ``get`` the non-resource URL
``/metrics`` (SubjectAccessReview). The agent decides nothing itself. Answers are cached for a minute
per token (by its sha256, never the token itself) so that a scrape every few seconds costs the API
server two requests a minute at most. The certificate is self-signed, made at start-up (scrapers use
``insecure_skip_verify`` or pin it, as with controller-runtime's default).

Status codes: 401 without a valid token, 403 when the identity may not read metrics, 200 otherwise.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kubectl_snapshot.core.errors import SnapshotError

log = logging.getLogger(__name__)
METRICS_PATH = "/metrics"
CACHE_S = 60.0


class ReviewApi(Protocol):
    """The two API calls the server needs (kubectl_snapshot.adapters.kube.KubeClient has them)."""

    def token_review(self, token: str) -> dict[str, Any]: ...
    def subject_access_review(self, user: dict[str, Any], *, path: str, verb: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Decision:
    code: int  # 200, 401 or 403
    who: str


class Authorizer:
    def __init__(self, api: ReviewApi, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.clock = api, clock
        self._cache: dict[str, tuple[float, Decision]] = {}
        self._lock = threading.Lock()

    def check(self, authorization: str | None) -> Decision:
        if not authorization or not authorization.startswith("Bearer ") or len(authorization) < 8:
            return Decision(401, "")
        token = authorization[len("Bearer ") :].strip()
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit and now - hit[0] < CACHE_S:
                return hit[1]
        decision = self._review(token)
        with self._lock:
            if len(self._cache) > 1000:  # many distinct tokens: forget rather than grow
                self._cache.clear()
            self._cache[key] = (now, decision)
        return decision

    def _review(self, token: str) -> Decision:
        try:
            tr = self.api.token_review(token)
        except SnapshotError as e:
            log.warning("metrics: TokenReview failed: %s", e)
            return Decision(401, "")
        status = tr.get("status") or {}
        if not status.get("authenticated"):
            return Decision(401, "")
        user = status.get("user") or {}
        who = str(user.get("username") or "")
        try:
            sar = self.api.subject_access_review(user, path=METRICS_PATH, verb="get")
        except SnapshotError as e:
            log.warning("metrics: SubjectAccessReview for %s failed: %s", who, e)
            return Decision(403, who)
        return Decision(200 if (sar.get("status") or {}).get("allowed") else 403, who)


def self_signed(names: list[str], directory: str) -> tuple[str, str]:
    """An EC P-256 certificate for `names` (DNS names or IPs), valid a year; returns (cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "kubectl-snapshot-agent")])
    sans: list[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
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


def serve(
    registry: CollectorRegistry,
    authorizer: Authorizer,
    *,
    host: str,
    port: int,
    names: list[str],
) -> ThreadingHTTPServer:
    """Start the HTTPS server in a daemon thread; returns it (``.shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != METRICS_PATH:
                self._reply(404, b"not found\n")
                return
            decision = authorizer.check(self.headers.get("Authorization"))
            if decision.code != 200:
                text = b"unauthorized\n" if decision.code == 401 else b"forbidden\n"
                self._reply(decision.code, text)
                return
            self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    tls_dir = tempfile.mkdtemp(prefix="ks-metrics-tls-")
    cert, key = self_signed(names, tls_dir)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    for p in (cert, key):
        os.unlink(p)  # loaded: nothing of the key stays on disk
    os.rmdir(tls_dir)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
