"""HTTP to a registry in one place: scheme choice, authentication, retries and error mapping.

Every registry request goes through ``Transport.request`` so that the rules hold everywhere:

* HTTPS unless ``plain_http`` or the registry is on loopback;
* anonymous first; a 401 is answered once with Basic or Bearer credentials (``auth.TokenAuth``),
  and the scheme learned is used preemptively afterwards (so large bodies are not sent twice);
* retries with exponential backoff only for connection errors, 429 and 502/503/504 (honouring
  ``Retry-After``), and only for requests whose body can be produced again;
* any other failure becomes a project error carrying the registry's ``errors[].code/message``.
"""

from __future__ import annotations

import email.utils
import logging
import os
import time
import urllib.request
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import IO, Any

import requests
import requests.adapters

from kubectl_snapshot.adapters.registry.token import TokenAuth
from kubectl_snapshot.core.errors import (
    DigestMismatch,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SnapshotError,
    Unavailable,
)
from kubectl_snapshot.core.reference import api_host, is_loopback_registry

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
POOL_SIZE = 32  # connections kept per registry host
MAX_RETRY_AFTER = 30.0
USER_AGENT = "kubectl-snapshot"

# A request body: bytes (re-sent as is), or a factory producing a fresh body for each attempt.
BodyData = bytes | IO[bytes] | Iterable[bytes]
Body = bytes | Callable[[], BodyData]

_PLAIN_HTTP_HINT = "check the registry address and that it is running; use --plain-http for a registry without TLS"


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 4
    backoff: float = 0.3
    max_backoff: float = 10.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), MAX_RETRY_AFTER)
        return float(min(self.backoff * (2**attempt), self.max_backoff))


def registry_errors(resp: requests.Response) -> str:
    """``CODE: message; ...`` from a distribution error body, or a short snippet of the body."""
    try:
        payload = resp.json()
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("errors"), list):
        parts = []
        for err in payload["errors"]:
            if isinstance(err, dict):
                code, message = err.get("code", ""), err.get("message", "")
                parts.append(f"{code}: {message}" if code and message else str(code or message))
        if parts:
            return "; ".join(parts)
    try:
        text = resp.text.strip()
    except Exception:  # a body that cannot be decoded
        text = ""
    return text[:200]


def error_codes(resp: requests.Response) -> set[str]:
    try:
        payload = resp.json()
    except ValueError:
        return set()
    if not isinstance(payload, dict) or not isinstance(payload.get("errors"), list):
        return set()
    return {str(e.get("code")) for e in payload["errors"] if isinstance(e, dict)}


def retry_after(resp: requests.Response) -> float | None:
    value = resp.headers.get("Retry-After")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def connection_reason(exc: BaseException) -> str:
    """A short human reason for a connection failure ("connection refused", "timed out", ...)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cur, ConnectionResetError):
            return "connection reset by peer"
        if isinstance(cur, TimeoutError | requests.Timeout):
            return "timed out"
        nxt = cur.__cause__ or cur.__context__
        if nxt is None and cur.args and isinstance(cur.args[0], BaseException):
            nxt = cur.args[0]
        if nxt is None and len(cur.args) > 1 and isinstance(cur.args[1], BaseException):
            nxt = cur.args[1]
        cur = nxt
    text = str(exc)
    if "refused" in text.lower():
        return "connection refused"
    return text[:300]


def error_for_status(resp: requests.Response, what: str, registry: str, *, has_credentials: bool) -> SnapshotError:
    """Map a failed response to the project's error tree."""
    status = resp.status_code
    detail = registry_errors(resp)
    msg = f"{what}: registry {registry} answered {status}" + (f" ({detail})" if detail else "")
    codes = error_codes(resp)
    if status == 401 or status == 403 or "DENIED" in codes or "UNAUTHORIZED" in codes:
        if has_credentials:
            return PermissionDenied(
                msg, hint=f"check the credentials for {registry} and that they may access this repository"
            )
        return PermissionDenied(
            msg,
            hint=f"no credentials for {registry}: run `docker login {registry}` or pass --registry-secret",
        )
    if status == 404:
        return NotFound(msg, hint="check the reference (registry, repository, tag or digest)")
    if codes & {"DIGEST_INVALID", "SIZE_INVALID"}:
        return DigestMismatch(msg, hint="the content changed while it was being uploaded; try again")
    if codes & {"NAME_INVALID", "TAG_INVALID"}:
        return InvalidArgument(msg, hint="check the repository name and tag")
    if status == 405 or "UNSUPPORTED" in codes:
        return FailedPrecondition(msg, hint="the registry does not support this operation (is delete enabled?)")
    if status == 413:
        return FailedPrecondition(msg, hint="the registry refuses content this large")
    if status in RETRYABLE_STATUS or status >= 500:
        return Unavailable(msg, hint="the registry is failing or overloaded; try again later")
    return Internal(msg)


def new_session() -> requests.Session:
    """The session registry clients share (TokenAuth's token requests too)."""
    session = requests.Session()
    # Chunks are uploaded and fetched by up to 16 threads: keep a connection per thread alive
    # (requests' default pool of 10 would drop and reopen the surplus on every request).
    for prefix in ("http://", "https://"):
        session.mount(prefix, requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=POOL_SIZE))
    read_environment_once(session)
    return session


def read_environment_once(session: requests.Session, environ: Mapping[str, str] = os.environ) -> None:
    """What requests would look up in the environment on every request, looked up once, where that is
    the same: with `trust_env` requests reads every variable of the process twice per request for
    proxy settings (a fifth of a request's client CPU in a small environment, two thirds with 400 more
    variables such as a pod's service links: bench/client_cpu.py), and a netrc file. Where neither is
    there, only the CA bundle variables remain, and they become the session's `verify`; otherwise
    nothing changes."""
    if urllib.request.getproxies_environment() or _netrc_file(environ) is not None:
        return
    bundle = environ.get("REQUESTS_CA_BUNDLE") or environ.get("CURL_CA_BUNDLE")
    if bundle and session.verify is True:
        session.verify = bundle
    session.trust_env = False


def _netrc_file(environ: Mapping[str, str]) -> str | None:
    """The netrc file requests would read credentials from (requests.utils.get_netrc_auth), if any."""
    candidates = [environ["NETRC"]] if environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for c in candidates:
        try:
            path = os.path.expanduser(c)
        except KeyError:  # no home directory
            continue
        if os.path.exists(path):
            return path
    return None


class Transport:
    """A requests.Session bound to the project's registry rules."""

    def __init__(
        self,
        *,
        auth: TokenAuth,
        plain_http: bool,
        retry: RetryPolicy,
        timeout: float,
        session: requests.Session | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.session = session or new_session()
        self.session.headers.setdefault("User-Agent", USER_AGENT)
        self.auth = auth
        self.plain_http = plain_http
        self.retry = retry
        self.timeout = timeout
        self._sleep = sleep

    def base_url(self, registry: str) -> str:
        scheme = "http" if self.plain_http or is_loopback_registry(registry) else "https"
        return f"{scheme}://{api_host(registry)}"

    def request(
        self,
        method: str,
        registry: str,
        url: str,
        *,
        what: str,
        repository: str | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        body: Body | None = None,
        stream: bool = False,
        allow: Collection[int] = (),
        retry: bool = True,
    ) -> requests.Response:
        """Send one logical request. `url` may be a path (``/v2/...``) or an absolute URL.

        Returns the response when its status is < 400 or in `allow`; raises otherwise.
        `retry=False` disables the retry loop (the caller restarts a larger operation instead).
        """
        if url.startswith("/"):
            url = self.base_url(registry) + url
        attempt = 0
        auth_answered = False
        while True:
            req_headers = dict(headers or {})
            auth_header = self.auth.header_for(registry, repository, method)
            if auth_header:
                req_headers["Authorization"] = auth_header
            data: Any = body() if callable(body) else body
            try:
                resp = self.session.request(
                    method,
                    url,
                    headers=req_headers,
                    params=params,
                    data=data,
                    stream=stream,
                    allow_redirects=True,
                    timeout=(min(10.0, self.timeout), self.timeout),
                )
            except requests.exceptions.SSLError as exc:
                raise Unavailable(
                    f"{what}: TLS handshake with registry {registry} failed: {connection_reason(exc)}",
                    hint=_PLAIN_HTTP_HINT,
                ) from exc
            except (requests.ConnectionError, requests.Timeout) as exc:
                reason = connection_reason(exc)
                if retry and attempt < self.retry.retries:
                    delay = self.retry.delay(attempt, None)
                    log.debug("%s %s: %s, retrying in %.2fs", method, url, reason, delay)
                    attempt += 1
                    self._sleep(delay)
                    continue
                raise Unavailable(f"{what}: cannot reach registry {registry}: {reason}", hint=_PLAIN_HTTP_HINT) from exc
            finally:
                close = getattr(data, "close", None)
                if callable(close) and not isinstance(data, bytes):
                    close()
            status = resp.status_code
            if status == 401 and not auth_answered:
                auth_answered = True
                challenge = resp.headers.get("WWW-Authenticate", "")
                refused = error_for_status(resp, what, registry, has_credentials=self.auth.has_credentials(registry))
                resp.close()
                if self.auth.answer(registry, repository, method, challenge, what=what):
                    continue
                raise refused
            if status in RETRYABLE_STATUS and retry and attempt < self.retry.retries:
                delay = self.retry.delay(attempt, retry_after(resp))
                log.debug("%s %s: %d, retrying in %.2fs", method, url, status, delay)
                resp.close()
                attempt += 1
                self._sleep(delay)
                continue
            if status < 400 or status in allow:
                return resp
            err = error_for_status(resp, what, registry, has_credentials=self.auth.has_credentials(registry))
            resp.close()
            raise err
