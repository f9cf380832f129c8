"""This node's snapshot signing key: made by the agent at its first start, kept in its state dir.

One ECDSA P-256 key per node (``<state dir>/signing/node.key``, PKCS#8 PEM, mode 0600 in a 0700
directory, root's): a compromised node then signs only what its own key is trusted for, which the
trust ConfigMap binds to this node (docs/security.md, "Per-node signing keys"). The key is never
copied off the node: the state dir is a host path, so it outlives the agent's pod, and a re-imaged
node makes a new one (its old public key stays listed, so its earlier saves still restore).
"""

from __future__ import annotations

import contextlib
import os

from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.provenance import SigningKey

KEY_DIR = "signing"
KEY_FILE = "node.key"
MAX_KEY_BYTES = 16 << 10


def key_path(state_dir: str) -> str:
    return os.path.join(state_dir, KEY_DIR, KEY_FILE)


def load_or_create(state_dir: str) -> SigningKey:
    """The node's key, made on first use. Two agents starting at once keep the same one: the new file
    is linked into place only where none exists (never replaced), and the loser reads the winner's."""
    directory = os.path.join(state_dir, KEY_DIR)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)  # makedirs' mode is masked by the umask and ignored for an existing dir
    path = os.path.join(directory, KEY_FILE)
    key = _read(path)
    if key is not None:
        return key
    _write_new(path, SigningKey.generate(), replace=False)
    again = _read(path)
    if again is None:
        raise FailedPrecondition(f"the node's signing key {path} vanished while it was made")
    return again


def replace(state_dir: str) -> SigningKey:
    """A new key in place of the node's current one (retired by an administrator: its public key stays
    listed in the trust ConfigMap with its not-after, so what it signed before still verifies). The new
    file is renamed over the old one: a reader sees one key or the other, never a partial file."""
    directory = os.path.join(state_dir, KEY_DIR)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    key = SigningKey.generate()
    _write_new(os.path.join(directory, KEY_FILE), key, replace=True)
    return key


def _write_new(path: str, key: SigningKey, *, replace: bool) -> None:
    """`key` written to a private temporary file, synced, then put at `path`: renamed over what is there
    (`replace`), or linked only where nothing is (another agent's key, made first, stays)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key.to_pem())
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):  # another agent made one first: use that one
                os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):  # renamed into place
            os.unlink(tmp)


def _read(path: str) -> SigningKey | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FailedPrecondition(
            f"cannot open the node's signing key {path}: {e.strerror}",
            hint="it must be a plain file of root's; remove it to make a new key (a new key is registered anew)",
        ) from e
    with os.fdopen(fd, "rb") as f:
        os.fchmod(f.fileno(), 0o600)  # the private key is root's alone, whatever made the file
        pem = f.read(MAX_KEY_BYTES)
    return SigningKey.from_pem(pem, where=path)
