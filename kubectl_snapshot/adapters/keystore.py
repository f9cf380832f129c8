"""Where namespace keys live: the `KeyProvider` port of core/sealing.py, two implementations.

* `SecretKeyProvider` (the agent DaemonSet): ONE Secret of fixed name, ``kubectl-snapshot-keys``, in
  the agent's own namespace; one data entry per namespace (``<namespace>`` = its current key, 32
  random bytes; ``<namespace>.<keyId>`` = a rotated-out key kept for older snapshots).
  `kubectl snapshot install` creates the Secret (core/keysecret.py); the agent adds a namespace's
  entry on first use (an update with the resourceVersion, retried on conflicts between agents of
  several nodes) and creates no Secret. Why this shape: the agent then needs rights on this one
  Secret only (a Role in its namespace, `resourceNames`), never on the Secrets of tenant namespaces,
  and may create none; a tenant who can read Secrets in its own namespace cannot read
  its key either (a namespace admin could otherwise copy it and decrypt snapshots outside the
  cluster's control). Deleting an entry makes that namespace's snapshots unreadable (crypto-shredding).
* `FileKeyProvider` (the standalone agent against a plain containerd): one file per namespace in a
  0700 directory (``<namespace>.key``, mode 0600), created on first use.

A key id (`key_id_of`) names a key without revealing it; the config of a snapshot records it, so a
restore after a rotation finds the older key.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import threading
import time
from typing import Any, Protocol

from kubectl_snapshot.core import keysecret
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.encryption import KEY_BYTES
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kubectl_snapshot.core.sealing import KeyUse, LocalNamespaceKey, NamespaceKey, key_id_of, new_key

KEY_SECRET = K.KEY_SECRET
# containerd's namespace rule; Kubernetes namespaces (DNS labels) are a subset
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*$")
_KEY_ID_RE = re.compile(r"^k1-[0-9a-f]{16}$")
CACHE_S = 60.0
UPDATE_ATTEMPTS = 8


def _check_namespace(namespace: str) -> str:
    if not _NAMESPACE_RE.match(namespace) or len(namespace) > 200:
        raise InvalidArgument(f"cannot keep a key for namespace {namespace!r}: not a valid namespace name")
    return namespace


def _check_key_id(key_id: str) -> str:
    if not _KEY_ID_RE.match(key_id):
        raise FailedPrecondition(
            f"snapshot names an invalid key id {key_id!r}", hint="the artifact is damaged or was not made by us"
        )
    return key_id


def _pick(entries: dict[str, bytes], namespace: str, key_id: str | None) -> bytes | None:
    current = entries.get(namespace)
    if key_id is None or (current is not None and key_id_of(current) == key_id):
        return current
    return entries.get(f"{namespace}.{_check_key_id(key_id)}")


class FileKeyProvider:
    """Namespace keys as files `<dir>/<namespace>.key` (0600) in a 0700 directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def namespace_key(
        self, namespace: str, *, create: bool, key_id: str | None = None, use: KeyUse | None = None
    ) -> NamespaceKey:
        _check_namespace(namespace)
        entries: dict[str, bytes] = {}
        current = os.path.join(self.directory, f"{namespace}.key")
        raw = self._read(current)
        if raw is None and create and key_id is None:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            try:
                fd = os.open(current, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                raw = self._read(current)
            else:
                raw = new_key()
                with os.fdopen(fd, "wb") as f:
                    f.write(base64.b64encode(raw) + b"\n")
        if raw is not None:
            entries[namespace] = raw
        if key_id is not None:
            old = self._read(os.path.join(self.directory, f"{namespace}.{_check_key_id(key_id)}.key"))
            if old is not None:
                entries[f"{namespace}.{key_id}"] = old
        kek = _pick(entries, namespace, key_id)
        if kek is None:
            raise NotFound(
                f"no key for namespace {namespace!r}"
                + (f" with id {key_id}" if key_id else "")
                + f" in {self.directory}"
            )
        return LocalNamespaceKey(kek)

    @staticmethod
    def _read(path: str) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return _decode(f.read(256), path)


def _decode(value: bytes | str, where: str) -> bytes:
    try:
        raw = base64.b64decode(value, validate=False)
    except ValueError:
        raw = b""
    if len(raw) != KEY_BYTES:
        raise FailedPrecondition(
            f"the namespace key in {where} is not {KEY_BYTES} base64-encoded bytes",
            hint="restore it from a backup; a damaged key makes that namespace's snapshots unreadable",
        )
    return raw


class SecretStore(Protocol):
    """The Secrets API the key provider uses (adapters/kube.KubeClient)."""

    def get_secret(self, ns: str, name: str) -> dict[str, Any]: ...
    def replace_secret(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]: ...


class SecretKeyProvider:
    """Namespace keys as entries of one Secret in the agent's namespace (see the module docstring)."""

    def __init__(
        self, kube: SecretStore, *, namespace: str = K.AGENT_NAMESPACE, name: str = KEY_SECRET, cache_s: float = CACHE_S
    ) -> None:
        self.kube, self.namespace, self.name, self.cache_s = kube, namespace, name, cache_s
        self._lock = threading.Lock()
        self._cache: tuple[float, dict[str, bytes]] | None = None

    def namespace_key(
        self, namespace: str, *, create: bool, key_id: str | None = None, use: KeyUse | None = None
    ) -> NamespaceKey:
        _check_namespace(namespace)
        with self._lock:
            kek = _pick(self._entries(fresh=False), namespace, key_id)
            if kek is None:
                kek = _pick(self._entries(fresh=True), namespace, key_id)
            if kek is None and create and key_id is None:
                kek = self._add(namespace)
        if kek is None:
            raise NotFound(
                f"no key for namespace {namespace!r}"
                + (f" with id {key_id}" if key_id else "")
                + f" in secret {self.namespace}/{self.name}"
            )
        return LocalNamespaceKey(kek)

    def _entries(self, *, fresh: bool) -> dict[str, bytes]:
        now = time.monotonic()
        if not fresh and self._cache is not None and now - self._cache[0] < self.cache_s:
            return self._cache[1]
        try:
            obj = self.kube.get_secret(self.namespace, self.name)
        except NotFound:
            obj = {}
        entries = self._parse(obj)
        self._cache = (now, entries)
        return entries

    def _parse(self, obj: dict[str, Any]) -> dict[str, bytes]:
        where = f"secret {self.namespace}/{self.name}"
        return {k: _decode(v, f"{where} entry {k}") for k, v in (obj.get("data") or {}).items()}

    def _add(self, namespace: str) -> bytes:
        """Create the namespace's key; a concurrent agent's key wins (re-read on every conflict)."""
        for _ in range(UPDATE_ATTEMPTS):
            try:
                obj = self.kube.get_secret(self.namespace, self.name)
            except NotFound:
                raise FailedPrecondition(
                    f"secret {self.namespace}/{self.name} (the namespace keys) does not exist, and the agent"
                    " creates no Secrets",
                    hint="run kubectl snapshot install (it creates the Secret once and never replaces it); installed"
                    " from manifests/ or the Helm chart:"
                    f" kubectl -n {self.namespace} create secret generic {self.name}",
                ) from None
            entries = self._parse(obj)
            if namespace in entries:
                self._cache = (time.monotonic(), entries)
                return entries[namespace]
            kek = new_key()
            data = {k: base64.b64encode(v).decode() for k, v in entries.items()}
            data[namespace] = base64.b64encode(kek).decode()
            with contextlib.suppress(FailedPrecondition):  # 409: another agent wrote first; read again
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                self.kube.replace_secret(self.namespace, self.name, self._body(data, rv))
                entries[namespace] = kek
                self._cache = (time.monotonic(), entries)
                return kek
        raise FailedPrecondition(
            f"could not store a key for namespace {namespace!r} in secret {self.namespace}/{self.name} "
            f"after {UPDATE_ATTEMPTS} conflicting updates",
            hint="retry the snapshot",
            retryable=True,
        )

    def _body(self, data: dict[str, str], resource_version: str | None) -> dict[str, Any]:
        body = keysecret.key_secret(data, resource_version=resource_version)
        body["metadata"].update(name=self.name, namespace=self.namespace)
        return body
