"""A real registry for tests: Debian's ``docker-registry`` (distribution 2.8) on 127.0.0.1.

Fixtures (import ``registry_server`` and ``registry_server_factory`` into a test module; the fixture
names are ``registry`` and ``registry_factory``):
* ``registry``: session-scoped anonymous server (``.host``, ``.url``, ``.storage``, ``.stop()``,
  ``.start()`` restarts on the same port).
* ``registry_factory``: ``registry_factory(auth="htpasswd", users={"u": "p"})`` or
  ``registry_factory(auth="token", users=..., refresh_tokens={"rt": "u"})`` -> a fresh server,
  stopped at teardown. Token servers are ``.token_server`` (a loopback JWT issuer signing with
  ``openssl``; distribution checks the signature against our self-signed cert).

Everything skips with the reason when ``docker-registry`` (or htpasswd/openssl) is missing.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

REGISTRY_BIN = os.environ.get("KUBECTL_SNAPSHOT_REGISTRY_BIN", "/usr/bin/docker-registry")
SERVICE = "kubectl-snapshot-test-registry"
ISSUER = "kubectl-snapshot-test-issuer"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require(binary: str, package: str) -> str:
    path = binary if os.path.isabs(binary) else shutil.which(binary)
    if not path or not os.access(path, os.X_OK):
        pytest.skip(f"{binary} not found (install {package}; hack/install-node-deps.sh does)")
    return path


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def libtrust_key_id(der_spki: bytes) -> str:
    """distribution's key id: base32 of sha256(SubjectPublicKeyInfo)[:30], in groups of 4 by ':'."""
    encoded = base64.b32encode(hashlib.sha256(der_spki).digest()[:30]).decode("ascii").rstrip("=")
    return ":".join(encoded[i : i + 4] for i in range(0, len(encoded), 4))


class TokenServer:
    """A docker token service on loopback: GET with Basic auth, or POST refresh_token grant.

    Grants every requested action to a known user; anonymous requests get a token with no access
    (as real token services do), so the registry answers 401 insufficient_scope.
    """

    def __init__(self, workdir: Path, users: dict[str, str], refresh_tokens: dict[str, str]) -> None:
        self.openssl = require("openssl", "openssl")
        self.users = users
        self.refresh_tokens = refresh_tokens
        self.requests: list[dict[str, Any]] = []
        self.key = workdir / "token.key"
        self.cert = workdir / "token.crt"
        subprocess.run(
            [self.openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
             "-out", str(self.cert), "-days", "2", "-subj", "/CN=kubectl-snapshot-test-token"],
            check=True, capture_output=True,
        )  # fmt: skip
        der = subprocess.run(
            [self.openssl, "pkey", "-in", str(self.key), "-pubout", "-outform", "DER"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        self.kid = libtrust_key_id(der)
        handler = self._handler()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self._server.server_address[1]
        self.realm = f"http://127.0.0.1:{self.port}/token"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def sign(self, claims: dict[str, Any]) -> str:
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(
            [self.openssl, "dgst", "-sha256", "-sign", str(self.key)],
            input=signing_input.encode(), check=True, capture_output=True,
        ).stdout  # fmt: skip
        return f"{signing_input}.{_b64url(sig)}"

    def issue(self, subject: str | None, scopes: list[str]) -> str:
        access = []
        if subject is not None:
            for scope in scopes:
                kind, _, rest = scope.partition(":")
                name, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": name, "actions": actions.split(",")})
        now = int(time.time())
        return self.sign({
            "iss": ISSUER, "sub": subject or "", "aud": SERVICE, "exp": now + 300, "nbf": now - 10,
            "iat": now, "jti": uuid.uuid4().hex, "access": access,
        })  # fmt: skip

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                query = parse_qs(urlsplit(self.path).query)
                user: str | None = None
                header = self.headers.get("Authorization", "")
                if header.startswith("Basic "):
                    name, _, pw = base64.b64decode(header[6:]).decode().partition(":")
                    if server.users.get(name) != pw:
                        server.requests.append({"method": "GET", "user": name, "ok": False})
                        self._answer(401, {"details": "bad credentials"})
                        return
                    user = name
                server.requests.append({"method": "GET", "user": user, "scope": query.get("scope", [])})
                token = server.issue(user, query.get("scope", []))
                self._answer(200, {"token": token, "expires_in": 300})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                form = parse_qs(self.rfile.read(length).decode())
                user = server.refresh_tokens.get(form.get("refresh_token", [""])[0])
                ok = form.get("grant_type") == ["refresh_token"] and user is not None
                server.requests.append({"method": "POST", "user": user, "ok": ok})
                if not ok:
                    self._answer(401, {"error": "invalid_grant"})
                    return
                token = server.issue(user, form.get("scope", []))
                self._answer(200, {"access_token": token, "expires_in": 300})

        return Handler

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class RegistryServer:
    """One docker-registry process with its own storage dir and port (kept across restarts)."""

    def __init__(
        self,
        workdir: Path,
        *,
        auth: str | None = None,
        users: dict[str, str] | None = None,
        refresh_tokens: dict[str, str] | None = None,
    ) -> None:
        self.binary = require(REGISTRY_BIN, "docker-registry")
        self.workdir = workdir
        self.storage = workdir / "storage"
        self.storage.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self.users = users or {}
        self.token_server: TokenServer | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "registry.log"
        config: dict[str, Any] = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            # the blob descriptor cache is in upstream distribution's default configuration
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},
                "cache": {"blobdescriptor": "inmemory"},
            },
            "http": {"addr": self.host},
        }
        if auth == "htpasswd":
            htpasswd = require("htpasswd", "apache2-utils")
            lines = []
            for user, pw in self.users.items():
                out = subprocess.run([htpasswd, "-Bbn", user, pw], check=True, capture_output=True, text=True).stdout
                lines.append(out.strip())
            (workdir / "htpasswd").write_text("\n".join(lines) + "\n")
            config["auth"] = {"htpasswd": {"realm": "basic-realm", "path": str(workdir / "htpasswd")}}
        elif auth == "token":
            self.token_server = TokenServer(workdir, self.users, refresh_tokens or {})
            config["auth"] = {"token": {
                "realm": self.token_server.realm, "service": SERVICE, "issuer": ISSUER,
                "rootcertbundle": str(self.token_server.cert),
            }}  # fmt: skip
        elif auth is not None:
            raise ValueError(f"unknown auth {auth!r}")
        self.config_path = workdir / "config.yml"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML

    def start(self, timeout: float = 15.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self._proc = subprocess.Popen(
            [self.binary, "serve", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {self.log_tail()}")
            try:
                urllib.request.urlopen(f"{self.url}/v2/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # 401: up, wants auth
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"docker-registry did not come up on {self.host}: {self.log_tail()}")

    @property
    def pid(self) -> int:
        """The running registry's process id (benchmarks read its CPU time)."""
        if self._proc is None:
            raise RuntimeError("the registry is not running")
        return self._proc.pid

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        self.stop()
        if self.token_server is not None:
            self.token_server.stop()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def blob_path(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (for tampering tests)."""
        algo, hexa = digest.split(":", 1)
        return self.storage / "docker/registry/v2/blobs" / algo / hexa[:2] / hexa / "data"

    def ref(self, repository: str, tag: str | None = "latest") -> str:
        return f"{self.host}/{repository}" + (f":{tag}" if tag else "")


@pytest.fixture(scope="session", name="registry")
def registry_server() -> Iterator[RegistryServer]:
    """A shared anonymous registry; use unique repository names per test."""
    workdir = Path(tempfile.mkdtemp(prefix="ks-registry-"))
    server = RegistryServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(name="registry_factory")
def registry_server_factory(tmp_path: Path) -> Iterator[Callable[..., RegistryServer]]:
    """Start registries with auth variants; all are stopped at teardown."""
    servers: list[RegistryServer] = []

    def make(**kwargs: Any) -> RegistryServer:
        server = RegistryServer(tmp_path / f"registry-{len(servers)}", **kwargs)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.close()


# Import ``registry_server`` / ``registry_server_factory`` in test modules (the fixtures are named
# ``registry`` / ``registry_factory``): importing these aliases instead makes ruff report F811 on
# every test parameter.
registry = registry_server
registry_factory = registry_server_factory
