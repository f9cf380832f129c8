"""Registry credentials (docker config.json, kubernetes dockerconfigjson Secrets, explicit flags)
and the parsing of ``WWW-Authenticate`` challenges.

Credential lookup is keyed by the canonical registry name (see ``normalize_registry``), so the many
spellings docker writes (``https://index.docker.io/v1/``, ``http://host:5000``) all match.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.reference import normalize_registry

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


class CredentialStore:
    """Immutable map registry -> Credentials. Later sources override earlier ones."""

    def __init__(self, entries: Mapping[str, Credentials] | None = None) -> None:
        self._entries: Mapping[str, Credentials] = MappingProxyType(
            {normalize_registry(k): v for k, v in (entries or {}).items()}
        )

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
        return cls(entries)

    @classmethod
    def from_docker_config(cls, path: str | None = None) -> CredentialStore:
        """Read ``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``; a missing file gives an
        empty store (anonymous access). Credential helpers (credsStore) are not consulted."""
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
        The legacy ``.dockercfg`` form (a bare ``auths`` map) is accepted too."""
        store = cls._parse(data, "registry secret")
        return store

    @classmethod
    def _parse(cls, raw: bytes, where: str) -> CredentialStore:
        try:
            config = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"{where} is not valid JSON: {exc}", hint="check the file's content") from exc
        if isinstance(config, dict) and "auths" not in config and all(isinstance(v, dict) for v in config.values()):
            config = {"auths": config}  # legacy .dockercfg
        return cls._from_config(config, where)

    def with_explicit(self, registry: str, username: str, password: str) -> CredentialStore:
        """A copy where `registry` uses these credentials (flags beat config files)."""
        entries = dict(self._entries)
        entries[normalize_registry(registry)] = Credentials(username=username, password=password)
        return CredentialStore(entries)

    def merged(self, other: CredentialStore) -> CredentialStore:
        """A copy with `other`'s entries added, overriding ours."""
        return CredentialStore({**self._entries, **other._entries})

    def lookup(self, registry: str) -> Credentials | None:
        return self._entries.get(normalize_registry(registry))

    def registries(self) -> list[str]:
        return sorted(self._entries)

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
