"""Registry credentials (docker config.json, kubernetes dockerconfigjson Secrets, explicit flags)
and the parsing of ``WWW-Authenticate`` challenges.

Credential lookup is keyed by the canonical registry name (see ``normalize_registry``), so the many
spellings docker writes (``https://index.docker.io/v1/``, ``http://host:5000``) all match.

Docker credential helpers are consulted as docker, oras and crane do: ``credHelpers[registry]`` first,
then ``credsStore`` for every registry, then the ``auths`` entries. A helper is the executable
``docker-credential-NAME`` on PATH, run as ``docker-credential-NAME get`` with the registry on stdin; it
prints ``{"ServerURL", "Username", "Secret"}`` (``Username`` ``<token>``: ``Secret`` is an identity
token) or fails with "credentials not found". That is how ECR, GCR/Artifact Registry and ACR users log in.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kubectl_snapshot.core.errors import InvalidArgument, PermissionDenied, Unavailable
from kubectl_snapshot.core.reference import DOCKER_HUB, normalize_registry

# docker writes this user name when the secret is an identity (refresh) token, not a password
_TOKEN_USER = "<token>"


@dataclass(frozen=True)
class Credentials:
    """Either username/password (Basic auth, or Basic at the token endpoint) or an identity token
    (OAuth2 refresh token, POSTed to the token endpoint). Secrets are kept out of repr()."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    identity_token: str | None = field(default=None, repr=False)

    @property
    def has_password(self) -> bool:
        return self.username is not None and self.password is not None


def _decode_auth(value: str, where: str) -> tuple[str, str]:
    try:
        decoded = base64.b64decode(value, validate=False).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidArgument(
            f"{where}: the 'auth' field is not base64 of 'user:password'",
            hint="run `docker login` again or recreate the secret",
        ) from exc
    user, sep, password = decoded.partition(":")
    if not sep:
        raise InvalidArgument(
            f"{where}: the 'auth' field does not contain 'user:password'",
            hint="run `docker login` again or recreate the secret",
        )
    return user, password


def _entry_credentials(entry: Mapping[str, Any], where: str) -> Credentials | None:
    username = entry.get("username") or None
    password = entry.get("password") or None
    identity = entry.get("identitytoken") or entry.get("identityToken") or None
    if entry.get("auth"):
        username, password = _decode_auth(str(entry["auth"]), where)
    if identity:
        return Credentials(username=username, identity_token=str(identity))
    if username == _TOKEN_USER and password:
        return Credentials(identity_token=str(password))
    if username is not None and password is not None:
        return Credentials(username=str(username), password=str(password))
    return None


log = logging.getLogger(__name__)
HELPER_PREFIX = "docker-credential-"
HELPER_TIMEOUT_S = 60.0
_NOT_FOUND = "credentials not found"
_HELPER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def helper_server(registry: str) -> str:
    """What docker sends a helper on stdin: Docker Hub's legacy URL, else the registry as written."""
    return "https://index.docker.io/v1/" if normalize_registry(registry) == DOCKER_HUB else registry


def run_helper(name: str, registry: str, *, timeout: float = HELPER_TIMEOUT_S) -> Credentials | None:
    """``docker-credential-NAME get`` for `registry`: its credentials, or None when it has none."""
    if not _HELPER_NAME.match(name):
        raise InvalidArgument(f"docker config names credential helper {name!r}, which is not a helper name")
    exe = shutil.which(HELPER_PREFIX + name)
    if exe is None:
        raise PermissionDenied(
            f"the docker config says to get credentials for {registry} from {HELPER_PREFIX}{name}, "
            "which is not on PATH",
            hint=f"install {HELPER_PREFIX}{name} or remove it from credsStore/credHelpers in the docker config",
        )
    try:
        proc = subprocess.run(
            [exe, "get"], input=helper_server(registry), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(
            f"{HELPER_PREFIX}{name} did not answer within {timeout:.0f}s for {registry}",
            hint="check that the credential helper works: echo HOST | " + f"{HELPER_PREFIX}{name} get",
        ) from exc
    except OSError as exc:
        raise PermissionDenied(f"cannot run {exe}: {exc.strerror}", hint="check the helper's permissions") from exc
    out = proc.stdout.strip()
    if proc.returncode != 0:
        if _NOT_FOUND in (out + proc.stderr).lower():
            return None
        detail = (proc.stderr.strip() or out)[:300]
        raise PermissionDenied(
            f"credential helper {HELPER_PREFIX}{name} failed for {registry} (exit {proc.returncode}): {detail}",
            hint=f"log in again with the registry's tool, then check: echo {registry} | {HELPER_PREFIX}{name} get",
        )
    try:
        doc = json.loads(out)
        username, secret = doc.get("Username"), doc.get("Secret")
    except (ValueError, AttributeError) as exc:
        raise PermissionDenied(
            f"credential helper {HELPER_PREFIX}{name} printed no credentials JSON for {registry}",
            hint='it must print {"ServerURL": ..., "Username": ..., "Secret": ...}',
        ) from exc
    if not isinstance(secret, str) or not secret:
        return None
    if username == _TOKEN_USER:
        return Credentials(identity_token=secret)
    return Credentials(username=str(username or ""), password=secret)


class CredentialStore:
    """Immutable map registry -> Credentials, plus the docker config's credential helpers (run lazily, once
    per registry). Later sources override earlier ones; explicit credentials beat helpers."""

    def __init__(
        self,
        entries: Mapping[str, Credentials] | None = None,
        *,
        helpers: Mapping[str, str] | None = None,
        default_helper: str | None = None,
        explicit: frozenset[str] = frozenset(),
    ) -> None:
        self._entries: Mapping[str, Credentials] = MappingProxyType(
            {normalize_registry(k): v for k, v in (entries or {}).items()}
        )
        self._helpers: Mapping[str, str] = MappingProxyType(
            {normalize_registry(k): v for k, v in (helpers or {}).items() if v}
        )
        self._default_helper = default_helper or None
        self._explicit = frozenset(normalize_registry(r) for r in explicit)
        self._lock = threading.Lock()
        self._from_helpers: dict[str, Credentials | None] = {}

    @classmethod
    def _from_config(cls, config: Any, where: str) -> CredentialStore:
        if not isinstance(config, dict):
            raise InvalidArgument(f"{where}: expected a JSON object", hint="check the file's content")
        auths = config.get("auths", {})
        if not isinstance(auths, dict):
            raise InvalidArgument(f"{where}: 'auths' must be an object", hint="check the file's content")
        entries: dict[str, Credentials] = {}
        for key, entry in auths.items():
            if not isinstance(entry, dict):
                continue
            creds = _entry_credentials(entry, f"{where}: auths[{key!r}]")
            if creds is not None:
                entries[key] = creds
        helpers = config.get("credHelpers") or {}
        store = config.get("credsStore") or None
        if not isinstance(helpers, dict) or not all(isinstance(v, str) for v in helpers.values()):
            raise InvalidArgument(f"{where}: 'credHelpers' must map registries to helper names")
        if store is not None and not isinstance(store, str):
            raise InvalidArgument(f"{where}: 'credsStore' must be a helper name")
        return cls(entries, helpers=helpers, default_helper=store)

    @classmethod
    def from_docker_config(cls, path: str | None = None) -> CredentialStore:
        """Read ``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``; a missing file gives an
        empty store (anonymous access). Its credsStore/credHelpers are run when a registry is looked up."""
        if path is None:
            base = os.environ.get("DOCKER_CONFIG") or str(Path.home() / ".docker")
            path = os.path.join(base, "config.json")
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            return cls()
        except OSError as exc:
            raise InvalidArgument(
                f"cannot read docker config {path}: {exc.strerror}", hint="check the file's permissions"
            ) from exc
        return cls._parse(raw, f"docker config {path}")

    @classmethod
    def from_dockerconfigjson(cls, data: bytes) -> CredentialStore:
        """Parse a ``kubernetes.io/dockerconfigjson`` Secret payload (the decoded ``.dockerconfigjson``).
        The legacy ``.dockercfg`` form (a bare ``auths`` map) is accepted too. Credential helpers named
        in a Secret are ignored: a Secret is tenant data, and the agent runs no program a tenant names."""
        store = cls._parse(data, "registry secret")
        return cls(store._entries)

    @classmethod
    def _parse(cls, raw: bytes, where: str) -> CredentialStore:
        try:
            config = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"{where} is not valid JSON: {exc}", hint="check the file's content") from exc
        known = {"auths", "credHelpers", "credsStore"}
        if isinstance(config, dict) and not known & set(config) and all(isinstance(v, dict) for v in config.values()):
            config = {"auths": config}  # legacy .dockercfg
        return cls._from_config(config, where)

    def with_explicit(self, registry: str, username: str, password: str) -> CredentialStore:
        """A copy where `registry` uses these credentials (flags beat config files)."""
        entries = dict(self._entries)
        entries[normalize_registry(registry)] = Credentials(username=username, password=password)
        return CredentialStore(
            entries,
            helpers=self._helpers,
            default_helper=self._default_helper,
            explicit=self._explicit | {normalize_registry(registry)},
        )

    def merged(self, other: CredentialStore) -> CredentialStore:
        """A copy with `other`'s entries (and helpers) added, overriding ours."""
        return CredentialStore(
            {**self._entries, **other._entries},
            helpers={**self._helpers, **other._helpers},
            default_helper=other._default_helper or self._default_helper,
            explicit=self._explicit | other._explicit | frozenset(other._entries),
        )

    def helper_for(self, registry: str) -> str | None:
        """The credential helper docker would ask for `registry` (credHelpers, else credsStore)."""
        key = normalize_registry(registry)
        if key in self._explicit:
            return None
        return self._helpers.get(key) or self._default_helper

    def lookup(self, registry: str) -> Credentials | None:
        key = normalize_registry(registry)
        helper = self.helper_for(registry)
        if helper is not None and key not in self._helpers and shutil.which(HELPER_PREFIX + helper) is None:
            # credsStore names a helper this machine lacks (a config copied from Docker Desktop): the auths
            # entries and anonymous access still work; a missing credHelpers helper is an error (below)
            log.warning("credsStore %s%s is not on PATH; using the docker config's auths", HELPER_PREFIX, helper)
            helper = None
        if helper is not None:
            with self._lock:
                if key not in self._from_helpers:
                    self._from_helpers[key] = run_helper(helper, registry)
                found = self._from_helpers[key]
            if found is not None:
                return found
        return self._entries.get(key)

    def registries(self) -> list[str]:
        return sorted(set(self._entries) | set(self._helpers))

    def __repr__(self) -> str:
        return f"CredentialStore(registries={self.registries()!r})"


@dataclass(frozen=True)
class Challenge:
    """One ``WWW-Authenticate`` challenge: scheme ("basic"/"bearer", lowercase) and its parameters."""

    scheme: str
    params: Mapping[str, str]


_PARAM_RE = re.compile(r'\s*([A-Za-z][A-Za-z0-9_.-]*)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,"]+))\s*,?')


def parse_challenges(header: str) -> list[Challenge]:
    """Parse a ``WWW-Authenticate`` header (RFC 7235 auth-params, quoted or token values).

    Several challenges may appear in one header (``Basic realm="x", Bearer realm="y"``).
    """
    challenges: list[Challenge] = []
    pos = 0
    text = header.strip()
    while pos < len(text):
        m = re.compile(r"\s*,?\s*([A-Za-z][A-Za-z0-9_-]*)").match(text, pos)
        if not m or not m.group(1):
            break
        scheme = m.group(1).lower()
        pos = m.end()
        params: dict[str, str] = {}
        while pos < len(text):
            pm = _PARAM_RE.match(text, pos)
            if not pm:
                break
            # a bare word followed by a param is the next challenge's scheme, not a param
            params[pm.group(1).lower()] = (
                re.sub(r"\\(.)", r"\1", pm.group(2)) if pm.group(2) is not None else pm.group(3)
            )
            pos = pm.end()
        challenges.append(Challenge(scheme=scheme, params=MappingProxyType(params)))
    return challenges


def scope_for(repository: str, method: str) -> str:
    """The token scope a request needs: pull for reads, pull+push for writes, delete for DELETE."""
    method = method.upper()
    if method in ("GET", "HEAD"):
        actions = "pull"
    elif method == "DELETE":
        actions = "delete"
    else:
        actions = "pull,push"
    return f"repository:{repository}:{actions}"
