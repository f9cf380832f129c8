"""Snapshot signing keys for tests, as files the node-level agent CLI and cosign read.

``signing_env()`` gives the environment that makes `ks-agent checkpoint` sign with the
session's key and `restore`/`inspect` trust it (KUBECTL_SNAPSHOT_SIGNING_KEY / _TRUSTED_KEYS).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kubectl_snapshot.core.provenance import SigningKey


@dataclass(frozen=True)
class KeyFiles:
    key: SigningKey
    private: Path  # PKCS#8 PEM
    public: Path  # SubjectPublicKeyInfo PEM (what `cosign verify --key` takes)


def write_key(directory: Path, name: str) -> KeyFiles:
    key = SigningKey.generate()
    directory.mkdir(parents=True, exist_ok=True)
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    private.write_bytes(key.to_pem())
    private.chmod(0o600)
    public.write_bytes(key.public.to_pem())
    return KeyFiles(key, private, public)


@functools.cache
def session_key() -> KeyFiles:
    """One key per process (a test session, a bench run), removed when the process that made it exits
    (not by a forked child's exit)."""
    directory = Path(tempfile.mkdtemp(prefix="ks-signing-"))
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(directory, ignore_errors=True)

    atexit.register(remove)
    return write_key(directory, "session")


def signing_env() -> dict[str, str]:
    k = session_key()
    return {"KUBECTL_SNAPSHOT_SIGNING_KEY": str(k.private), "KUBECTL_SNAPSHOT_TRUSTED_KEYS": str(k.public)}


def sign(ref: str, origin_namespace: str, *, key: KeyFiles | None = None) -> None:
    """Sign a snapshot a test crafted by hand (REGISTRY/REPO@sha256:...) as an agent would, so that a
    restore gets past provenance to the check under test. `origin_namespace` must be the namespace its
    config states (config.pod.namespace, or config.namespace for node-level snapshots)."""
    from kubectl_snapshot.adapters.registry import RegistryClient
    from kubectl_snapshot.adapters.signatures import sign_snapshot
    from kubectl_snapshot.core.provenance import Origin
    from kubectl_snapshot.core.reference import Reference

    k = key or session_key()
    sign_snapshot(RegistryClient(), Reference.parse(ref), Origin(namespace=origin_namespace, format_version=3), k.key)
