"""The plugin's light connection to the API server: urllib3 and the standard library's TLS, with the
kubeconfig read by core/kubeconfig.py. Why not the official client here: importing it (every API class
and model) costs a `kubectl snapshot` command about 0.3 s before its first request, a third of what a lazy
restore of a big pod may add to a fresh start (docs/lazy-restore.md). What it covers is what kubeconfigs
carry: client certificates, bearer tokens (also from a tokenFile, read again each minute), basic auth,
exec credential plugins (client.authentication.k8s.io/v1 and v1beta1, run again when their credential
expires or is refused), the server's CA or insecure-skip-tls-verify, tls-server-name, and kubectl's flags.
A kubeconfig that needs more (core/kubeconfig.py: `Connection.unsupported`), a proxy in the environment,
or KUBECTL_SNAPSHOT_KUBE_CLIENT=official, goes to the official client (adapters/kube.py) as before.

Every answer outside 2xx raises `ApiError` (status, reason, body), as the official client's ApiException
does; kube.py maps both to the project's errors.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3
import yaml

from kubectl_snapshot import __version__
from kubectl_snapshot.core import kubeconfig as KC
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import FailedPrecondition, PermissionDenied

CLIENT_ENV = "KUBECTL_SNAPSHOT_KUBE_CLIENT"  # "official": always the kubernetes package's client
PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
TOKEN_FILE_TTL = 60.0  # seconds a tokenFile's token is used before it is read again (client-go's rule)
EXEC_TIMEOUT = 120.0  # a non-interactive credential plugin that has not answered by then has failed
EXPIRY_MARGIN = 10.0  # an exec credential this close to its expiry is asked for again
USER_AGENT = f"kubectl-snapshot/{__version__}"
LOAD_HINT = "pass --kubeconfig PATH or set $KUBECONFIG to a valid kubeconfig (or --server and --token)"


class ApiError(Exception):
    """An answer of the API server outside 2xx, or none (status 0)."""

    def __init__(self, status: int, reason: str, body: bytes | str | None = None) -> None:
        super().__init__(f"({status}) {reason}")
        self.status = status
        self.reason = reason
        self.body = body


def kubeconfig_files(kubeconfig: str | None) -> list[str]:
    """The files kubectl would read: --kubeconfig alone, else $KUBECONFIG's list, else ~/.kube/config."""
    if kubeconfig:
        return [os.path.expanduser(kubeconfig)]
    env = os.environ.get("KUBECONFIG")
    if env:
        return [os.path.expanduser(p) for p in env.split(os.pathsep) if p]
    return [os.path.expanduser("~/.kube/config")]


def kubeconfig_name(kubeconfig: str | None) -> str:
    """How an error names the kubeconfig read."""
    return kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"


def read_kubeconfig(kubeconfig: str | None) -> KC.Merged:
    """The merged files. A --kubeconfig that cannot be read is an error; a file of $KUBECONFIG's list
    that does not exist is skipped, as kubectl skips it."""
    paths = kubeconfig_files(kubeconfig)
    docs: list[tuple[str, Any]] = []
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                docs.append((os.path.abspath(path), yaml.load(f, Loader=loader)))
        except FileNotFoundError:
            if kubeconfig:
                raise
        except yaml.YAMLError as e:
            raise KC.KubeconfigInvalid(f"{path} is not valid YAML: {e}") from e
    return KC.merge(docs)


def load(
    kubeconfig: str | None,
    context: str | None,
    *,
    server: str | None = None,
    token: str | None = None,
    impersonate: str | None = None,
    impersonate_groups: tuple[str, ...] = (),
) -> LightApi | None:
    """The light connection the kubeconfig and flags name, or None where the official client must
    serve them (see the module's docstring). Raises FailedPrecondition for a kubeconfig that cannot be
    used, InvalidArgument for a --context it does not have."""
    if os.environ.get(CLIENT_ENV) == "official" or any(os.environ.get(k) for k in PROXY_ENV):
        return None
    where = kubeconfig_name(kubeconfig)
    try:
        merged = read_kubeconfig(kubeconfig)
        conn = KC.resolve(
            merged,
            where=where,
            context=context,
            server=server,
            token=token,
            impersonate=impersonate,
            impersonate_groups=impersonate_groups,
        )
    except (KC.KubeconfigInvalid, OSError) as e:
        raise FailedPrecondition(f"cannot load kubeconfig {where}: {e}", hint=LOAD_HINT) from e
    if conn.unsupported:
        return None
    return LightApi(conn)


def _timeout(value: float | tuple[float, float] | None) -> urllib3.Timeout | None:
    if value is None:
        return None
    if isinstance(value, tuple):
        return urllib3.Timeout(connect=value[0], read=value[1])
    return urllib3.Timeout(total=value)


def _pem(source: KC.FileOrData | None) -> bytes:
    if source is None:
        return b""
    if source.data:
        return source.data
    try:
        with open(source.path, "rb") as f:
            return f.read()
    except OSError as e:
        raise FailedPrecondition(
            f"cannot read {source.path}, which the kubeconfig names: {e.strerror or e}",
            hint="fix the path in the kubeconfig (relative paths are relative to the kubeconfig's own directory)",
        ) from e


class _ExecCredential:
    """A credential from an exec plugin: a token, or a client certificate and key."""

    def __init__(self, token: str = "", cert: bytes = b"", key: bytes = b"", expires: float | None = None) -> None:
        self.token, self.cert, self.key, self.expires = token, cert, key, expires

    def fresh(self, now: float) -> bool:
        return self.expires is None or now < self.expires - EXPIRY_MARGIN


def run_exec_plugin(conn: KC.Connection) -> _ExecCredential:
    """Run the kubeconfig's credential plugin as kubectl runs it (KUBERNETES_EXEC_INFO, the user's
    terminal for its prompts where it may ask), and read its ExecCredential."""
    plugin = conn.exec
    assert plugin is not None
    terminal = sys.stdin is not None and sys.stdin.isatty()
    if plugin.interactive_mode == "Always" and not terminal:
        raise FailedPrecondition(
            f"the kubeconfig's credential plugin {plugin.command!r} must ask on a terminal "
            "(interactiveMode: Always), and standard input is not one",
            hint="run the command from a terminal, or log in with the plugin first",
        )
    interactive = terminal and plugin.interactive_mode != "Never"
    spec: dict[str, Any] = {"interactive": interactive}
    if plugin.provide_cluster_info:
        info = {k: v for k, v in conn.cluster.items() if k in ("server", "tls-server-name", "insecure-skip-tls-verify")}
        if conn.ca is not None:
            info["certificate-authority-data"] = _b64(_pem(conn.ca))
        info["server"] = conn.server
        spec["cluster"] = info  # its keys as the kubeconfig's (client-go's clientauthentication Cluster)
    env = {**os.environ, **dict(plugin.env)}
    env["KUBERNETES_EXEC_INFO"] = json.dumps({"apiVersion": plugin.api_version, "kind": "ExecCredential", "spec": spec})
    what = f"the kubeconfig's credential plugin {plugin.command!r}"
    if not os.path.isabs(plugin.command) and shutil.which(plugin.command, path=env.get("PATH")) is None:
        raise FailedPrecondition(
            f"{what} is not on $PATH", hint=plugin.install_hint or "install it, or fix the kubeconfig"
        )
    try:
        done = subprocess.run(  # the user's kubeconfig names it, as for kubectl
            [plugin.command, *plugin.args],
            env=env,
            stdin=None if interactive else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            timeout=None if interactive else EXEC_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FailedPrecondition(f"{what} failed: {e}", hint=plugin.install_hint or "run it yourself to see why") from e
    if done.returncode != 0:
        raise PermissionDenied(f"{what} exited with {done.returncode}", hint="run it yourself to see why")
    try:
        cred = json.loads(done.stdout)
        status = cred["status"]
        assert isinstance(status, dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise PermissionDenied(f"{what} printed no ExecCredential with a status", hint="run it yourself") from e
    if cred.get("apiVersion") != plugin.api_version:
        raise PermissionDenied(f"{what} answered apiVersion {cred.get('apiVersion')!r}, not {plugin.api_version}")
    token = str(status.get("token") or "")
    cert = str(status.get("clientCertificateData") or "").encode()
    key = str(status.get("clientKeyData") or "").encode()
    if not token and not (cert and key):
        raise PermissionDenied(f"{what} gave neither a token nor a client certificate and key")
    return _ExecCredential(token, cert, key, T.seconds(status.get("expirationTimestamp")))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ssl_context(conn: KC.Connection, cert: bytes = b"", key: bytes = b"") -> ssl.SSLContext:
    """TLS to the API server as the kubeconfig says: its CA (else the system's), or no verification
    with insecure-skip-tls-verify; the client certificate (from the plugin when it gave one)."""
    if conn.insecure:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif conn.ca is not None:  # the kubeconfig's CA alone: the system's bundle is not read
        ctx = ssl.create_default_context(cadata=_pem(conn.ca).decode("ascii", "replace"))
    else:
        ctx = ssl.create_default_context()
    cert = cert or _pem(conn.client_cert)
    key = key or _pem(conn.client_key)
    if cert or key:
        if not (cert and key):
            raise FailedPrecondition(
                f"the kubeconfig's user in context {conn.context!r} has a client certificate without its key, "
                "or a key without its certificate",
                hint="give both client-certificate(-data) and client-key(-data)",
            )
        with tempfile.TemporaryDirectory(prefix="ks-kube-") as d:  # ssl reads the pair from files only
            cert_path, key_path = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
            for path, data in ((cert_path, cert), (key_path, key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
            ctx.load_cert_chain(cert_path, key_path)
    return ctx


class LightApi:
    """Requests to one API server with one set of credentials (thread-safe)."""

    def __init__(self, conn: KC.Connection) -> None:
        self.conn = conn
        self.host = conn.server.rstrip("/")
        self.namespace = conn.namespace
        self._lock = threading.Lock()
        self._pool: urllib3.PoolManager | None = None
        self._token_read = (0.0, "")  # (when, token) of the tokenFile
        self._exec: _ExecCredential | None = None
        if urlsplit(self.host).scheme not in ("https", "http"):
            raise FailedPrecondition(
                f"the API server {self.host!r} is not an http(s) URL", hint="fix the cluster's server in the kubeconfig"
            )

    def _credentials(self, now: float) -> tuple[urllib3.PoolManager, str]:
        """The pool (its TLS carries a client certificate) and the Authorization header value."""
        with self._lock:
            conn = self.conn
            if conn.exec is not None and (self._exec is None or not self._exec.fresh(now)):
                old = self._exec
                self._exec = run_exec_plugin(conn)
                if old is None or (old.cert, old.key) != (self._exec.cert, self._exec.key):
                    self._pool = None
            if self._pool is None:
                cred = self._exec or _ExecCredential()
                ctx = ssl_context(conn, cred.cert, cred.key)
                self._pool = urllib3.PoolManager(
                    num_pools=2,
                    maxsize=8,
                    ssl_context=ctx,
                    server_hostname=conn.tls_server_name or None,
                    assert_hostname=False if conn.insecure else None,
                    cert_reqs=ssl.CERT_NONE if conn.insecure else ssl.CERT_REQUIRED,
                )
            return self._pool, self._authorization(now)

    def _authorization(self, now: float) -> str:
        conn = self.conn
        if self._exec is not None and self._exec.token:
            return f"Bearer {self._exec.token}"
        if conn.token:
            return f"Bearer {conn.token}"
        if conn.token_file:
            when, token = self._token_read
            if not token or now - when > TOKEN_FILE_TTL:
                token = _pem(KC.FileOrData(path=conn.token_file)).decode("utf-8", "replace").strip()
                self._token_read = (now, token)
            return f"Bearer {token}"
        if conn.username or conn.password:
            return "Basic " + _b64(f"{conn.username}:{conn.password}".encode())
        return ""

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        timeout: float | tuple[float, float] | None = None,
    ) -> urllib3.BaseHTTPResponse:
        """The answer, its body not read yet (2xx); ApiError otherwise."""
        url = self.host + path + (f"?{urlencode(list(query.items()))}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):
            pool, authorization = self._credentials(time.time())
            hdrs = urllib3.HTTPHeaderDict({"User-Agent": USER_AGENT, **(headers or {})})
            if authorization:
                hdrs["Authorization"] = authorization
            if self.conn.impersonate:
                hdrs["Impersonate-User"] = self.conn.impersonate
                for group in self.conn.impersonate_groups:
                    hdrs.add("Impersonate-Group", group)
            resp = pool.request(
                method, url, body=data, headers=hdrs, timeout=_timeout(timeout), preload_content=False, redirect=False
            )
            if 200 <= resp.status < 300:
                return resp
            content = resp.data
            resp.release_conn()
            if resp.status == 401 and attempt == 0 and self.conn.exec is not None:
                with self._lock:  # refused: the plugin's credential is asked for again, once
                    self._exec = None
                continue
            raise ApiError(resp.status, resp.reason or "", content)
        raise AssertionError("unreachable")
