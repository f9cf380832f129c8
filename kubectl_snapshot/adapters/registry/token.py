"""Answering registry auth challenges: Basic, and Bearer tokens per the docker token spec.

State kept per registry: the scheme its last challenge asked for (so later requests authenticate
preemptively and large bodies are sent once) and, for Bearer, tokens cached per (registry, scope)
until shortly before they expire.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests

from kubectl_snapshot.adapters.registry.auth import (
    Challenge,
    Credentials,
    CredentialStore,
    parse_challenges,
    scope_for,
)
from kubectl_snapshot.core.errors import Internal, PermissionDenied, Unavailable
from kubectl_snapshot.core.reference import is_loopback_registry, normalize_registry

log = logging.getLogger(__name__)

CLIENT_ID = "kubectl-snapshot"
DEFAULT_TOKEN_LIFETIME = 60.0
EXPIRY_MARGIN = 10.0


@dataclass
class _Token:
    value: str
    expires_at: float


def _login_hint(registry: str) -> str:
    return f"run `docker login {registry}` or pass --registry-secret with a kubernetes.io/dockerconfigjson Secret"


class TokenAuth:
    """Produces the ``Authorization`` header for a request and answers 401 challenges."""

    def __init__(
        self,
        credentials: CredentialStore,
        *,
        session: requests.Session,
        timeout: float,
        plain_http: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.credentials = credentials
        self.session = session
        self.timeout = timeout
        self.plain_http = plain_http
        self._clock = clock
        self._lock = threading.Lock()
        self._schemes: dict[str, Challenge] = {}
        self._tokens: dict[tuple[str, str], _Token] = {}

    def has_credentials(self, registry: str) -> bool:
        return self.credentials.lookup(registry) is not None

    def header_for(self, registry: str, repository: str | None, method: str) -> str | None:
        """The header to send preemptively, or None (anonymous) when no challenge was seen yet."""
        key = normalize_registry(registry)
        with self._lock:
            challenge = self._schemes.get(key)
        if challenge is None:
            return None
        if challenge.scheme == "basic":
            return self._basic_header(registry)
        scope = scope_for(repository, method) if repository else ""
        token = self._cached(key, scope)
        if token is None:
            token = self._fetch_token(registry, challenge, scope, what="authenticate")
        return f"Bearer {token}"

    def answer(self, registry: str, repository: str | None, method: str, header: str, *, what: str) -> bool:
        """React to a 401 with `header` (WWW-Authenticate). True when the request should be retried
        with new credentials; raises PermissionDenied when the registry needs credentials we lack."""
        key = normalize_registry(registry)
        challenges = {c.scheme: c for c in parse_challenges(header)}
        creds = self.credentials.lookup(registry)
        if "bearer" in challenges:
            challenge = challenges["bearer"]
            scope = challenge.params.get("scope") or (scope_for(repository, method) if repository else "")
            with self._lock:  # the token we sent (if any) was not good enough: get a fresh one
                self._tokens.pop((key, scope), None)
            token = self._fetch_token(registry, challenge, scope, what=what)
            with self._lock:
                self._schemes[key] = challenge
                if repository:
                    self._store(key, scope_for(repository, method), token)
            return True
        if "basic" in challenges:
            if creds is None or not creds.has_password:
                raise PermissionDenied(
                    f"{what}: registry {registry} requires credentials and none are configured for it",
                    hint=_login_hint(registry),
                )
            with self._lock:
                already = self._schemes.get(key)
                self._schemes[key] = challenges["basic"]
            # if basic was already in use, the credentials were just refused
            return already is None or already.scheme != "basic"
        if not challenges:
            return False
        raise PermissionDenied(
            f"{what}: registry {registry} asks for unsupported authentication {sorted(challenges)}",
            hint="only Basic and Bearer (docker token) authentication are supported",
        )

    # --- internals -----------------------------------------------------------------------------

    def _basic_header(self, registry: str) -> str | None:
        creds = self.credentials.lookup(registry)
        if creds is None or not creds.has_password:
            return None
        raw = f"{creds.username}:{creds.password}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")

    def _cached(self, key: str, scope: str) -> str | None:
        with self._lock:
            token = self._tokens.get((key, scope))
            if token is not None and token.expires_at > self._clock():
                return token.value
        return None

    def _store(self, key: str, scope: str, token: str, lifetime: float = DEFAULT_TOKEN_LIFETIME) -> None:
        self._tokens[(key, scope)] = _Token(token, self._clock() + max(lifetime - EXPIRY_MARGIN, 1.0))

    def _fetch_token(self, registry: str, challenge: Challenge, scope: str, *, what: str) -> str:
        key = normalize_registry(registry)
        cached = self._cached(key, scope)
        if cached is not None:
            return cached
        realm = challenge.params.get("realm", "")
        parts = urlsplit(realm)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise PermissionDenied(
                f"{what}: registry {registry} sent a token realm that is not a URL: {realm!r}",
                hint="the registry's auth configuration is broken; report it to its operator",
            )
        creds = self.credentials.lookup(registry)
        if creds is not None and parts.scheme == "http" and not (self.plain_http or is_loopback_registry(parts.netloc)):
            raise PermissionDenied(
                f"{what}: refusing to send credentials for {registry} to a plain-HTTP token service {realm}",
                hint="use a token service with TLS, or --plain-http if this network is trusted",
            )
        service = challenge.params.get("service")
        try:
            resp = self._token_request(realm, service, scope, creds)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise Unavailable(
                f"{what}: cannot reach the token service {realm} of registry {registry}: {exc}",
                hint="check that the registry's token service is reachable from here",
            ) from exc
        if resp.status_code in (401, 403):
            who = f"user {creds.username!r}" if creds and creds.username else "the identity token"
            if creds is None:
                raise PermissionDenied(
                    f"{what}: registry {registry} requires credentials and none are configured for it",
                    hint=_login_hint(registry),
                )
            raise PermissionDenied(
                f"{what}: the token service of registry {registry} refused the credentials of {who}",
                hint=f"check the credentials for {registry} (`docker login {registry}` again)",
            )
        if resp.status_code >= 400:
            raise Unavailable(
                f"{what}: the token service {realm} of registry {registry} answered {resp.status_code}",
                hint="try again later",
            )
        try:
            payload = resp.json()
            token = payload.get("token") or payload.get("access_token")
            lifetime = float(payload.get("expires_in") or DEFAULT_TOKEN_LIFETIME)
        except (ValueError, AttributeError, TypeError) as exc:
            raise Internal(f"{what}: the token service of registry {registry} sent an invalid answer") from exc
        if not isinstance(token, str) or not token:
            raise Internal(f"{what}: the token service of registry {registry} sent no token")
        with self._lock:
            self._store(key, scope, token, lifetime)
        return token

    def _token_request(
        self, realm: str, service: str | None, scope: str, creds: Credentials | None
    ) -> requests.Response:
        timeout = (min(10.0, self.timeout), self.timeout)
        if creds is not None and creds.identity_token:
            form = {
                "grant_type": "refresh_token",
                "refresh_token": creds.identity_token,
                "client_id": CLIENT_ID,
            }
            if service:
                form["service"] = service
            if scope:
                form["scope"] = scope
            return self.session.post(realm, data=form, timeout=timeout)
        params = {"client_id": CLIENT_ID}
        if service:
            params["service"] = service
        if scope:
            params["scope"] = scope
        auth = (creds.username or "", creds.password or "") if creds and creds.has_password else None
        return self.session.get(realm, params=params, auth=auth, timeout=timeout)
