"""Encryption at rest: every layer and page chunk sealed with AES-256-GCM under a per-blob data key,
the data keys wrapped by the snapshot namespace's key-encryption key (envelope encryption).

Blob framing (a stream of segments, so that a GiB layer is never one GCM message and never held whole
in memory)::

    header  = MAGIC (8 bytes) || segment size S (u32 big endian)
    segment = AES-256-GCM(dek, nonce = 0x00000000 || u64 index,
                          plaintext = up to S bytes, aad = header || u64 index || u8 final)

Every segment but the last holds exactly S plaintext bytes; the last one (``final = 1``, possibly
empty) ends the blob. The index in nonce and AAD refuses reordered or duplicated segments, the final
flag refuses a truncated blob (a stream cut after a full segment has no final segment) and bytes after
it, the header in the AAD refuses a changed segment size.

Data keys: a layer gets a random key; a page chunk gets a *convergent* key,
``HMAC(namespace key, "chunk" || seed)``, so the same chunk content in the same namespace seals to the
same ciphertext, the same digest, and is found in the registry by the incremental upload. The seed is
the plaintext's sha256 (collision resistant, and it determines the plaintext), so each key is used for
exactly one plaintext and the index-based nonces never repeat under one key.

Wrapping: ``AES-256-GCM(wrap key, random nonce, dek, aad = label || namespace || ciphertext digest)``:
a wrapped key opens only with its namespace's key and only for the blob whose digest it names.

The namespace key itself sits behind the `KeyProvider` port (a Secret in the agent's namespace, a
key file for the standalone agent; an external KMS can implement the same three operations).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol, overload

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kubectl_snapshot.core.encryption import KEY_BYTES, SCHEME, WRAPPED_BYTES, EncryptionInfo
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument

MAGIC = b"KSENC\x00\x01\n"
HEADER = struct.Struct(">8sI")
SEGMENT_SIZE = 1 << 20
MIN_SEGMENT, MAX_SEGMENT = 4096, 16 << 20
TAG = 16
WRAP_NONCE = 12
_WRAP_LABEL = b"kubectl-snapshot/dek/v1\x00"
_CHUNK_LABEL = b"kubectl-snapshot/chunk-key/v1\x00"
_TAMPER_HINT = "the snapshot was tampered with or damaged; nothing of it was used"
WRAP_BATCH = 128  # data keys wrapped or unwrapped in one call (a key broker request stays under 64 KiB)


class DecryptionFailed(FailedPrecondition):
    """A wrapped key or a sealed blob did not authenticate (wrong key, tampering, truncation)."""


# --- the key port ------------------------------------------------------------------------------------


class NamespaceKey(Protocol):
    """What sealing needs from one namespace's key-encryption key (a KMS can do these remotely)."""

    @property
    def key_id(self) -> str: ...
    def wrap(self, dek: bytes, aad: bytes) -> bytes: ...
    def unwrap(self, wrapped: bytes, aad: bytes) -> bytes: ...
    def mac(self, data: bytes) -> bytes: ...
    # several at once (a remote key answers them in one round trip): (dek, aad) -> wrapped, (wrapped, aad) -> dek
    def wrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]: ...
    def unwrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]: ...


@dataclass(frozen=True)
class KeyUse:
    """Whose save or restore a key is for: the pod (its namespace, name, uid) and, for a restore, the
    snapshot opened (``REGISTRY/REPOSITORY@sha256:...``). The key broker answers only for such a use of
    a pod on the caller's node (core/keyaccess.py); the local providers need none."""

    namespace: str
    pod_name: str
    pod_uid: str
    snapshot: str = ""
    # a restore's snapshot as read (its manifest, then its config): the broker opens only its data keys
    manifest: bytes = field(default=b"", repr=False)
    config: bytes = field(default=b"", repr=False)

    @property
    def purpose(self) -> str:
        return "restore" if self.snapshot else "save"


class KeyProvider(Protocol):
    def namespace_key(
        self, namespace: str, *, create: bool, key_id: str | None = None, use: KeyUse | None = None
    ) -> NamespaceKey:
        """The namespace's current key (`create`: make one on first use), or the one named `key_id`
        (restore of an older snapshot after a rotation), for `use`. Raises NotFound when there is none."""
        ...


def key_id_of(kek: bytes) -> str:
    """A public name for a key: leaks nothing of it (HMAC of a fixed label)."""
    return "k1-" + hmac.new(kek, b"kubectl-snapshot/key-id/v1", hashlib.sha256).hexdigest()[:16]


class LocalNamespaceKey:
    """A 32-byte key held in this process; two independent subkeys are derived with HKDF."""

    def __init__(self, kek: bytes) -> None:
        if len(kek) != KEY_BYTES:
            raise InvalidArgument(f"a namespace key is {KEY_BYTES} bytes, got {len(kek)}")
        self._wrap = AESGCM(_hkdf(kek, b"wrap"))
        self._mac = _hkdf(kek, b"convergent")
        self._id = key_id_of(kek)

    @property
    def key_id(self) -> str:
        return self._id

    def wrap(self, dek: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(WRAP_NONCE)
        return nonce + self._wrap.encrypt(nonce, dek, aad)

    def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        if len(wrapped) != WRAPPED_BYTES:
            raise DecryptionFailed("a wrapped data key has the wrong length", hint=_TAMPER_HINT)
        try:
            return self._wrap.decrypt(wrapped[:WRAP_NONCE], wrapped[WRAP_NONCE:], aad)
        except InvalidTag:
            raise DecryptionFailed(
                "a data key of the snapshot does not open with this namespace's key",
                hint="the snapshot was sealed for another namespace or with another key, or was tampered with",
            ) from None

    def mac(self, data: bytes) -> bytes:
        return hmac.new(self._mac, data, hashlib.sha256).digest()

    def wrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        return [self.wrap(dek, aad) for dek, aad in items]

    def unwrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        return [self.unwrap(wrapped, aad) for wrapped, aad in items]


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def _hkdf(kek: bytes, info: bytes) -> bytes:
    return HKDF(hashes.SHA256(), KEY_BYTES, salt=None, info=b"kubectl-snapshot/" + info).derive(kek)


# --- framing -----------------------------------------------------------------------------------------


def _nonce(index: int) -> bytes:
    return b"\x00\x00\x00\x00" + index.to_bytes(8, "big")


def _aad(header: bytes, index: int, final: bool) -> bytes:
    return header + index.to_bytes(8, "big") + (b"\x01" if final else b"\x00")


def seal_stream(pieces: Iterable[bytes], dek: bytes, *, segment_size: int = SEGMENT_SIZE) -> Iterator[bytes]:
    """Encrypt a stream of plaintext pieces (any sizes) into header + segments, lazily."""
    if not MIN_SEGMENT <= segment_size <= MAX_SEGMENT:
        raise InvalidArgument(f"segment size {segment_size} out of range")
    aead = AESGCM(dek)
    header = HEADER.pack(MAGIC, segment_size)
    yield header
    buf = bytearray()
    index = 0
    it = iter(pieces)
    try:
        for piece in it:
            buf += piece
            # keep at least one byte back: the last segment must be sealed as final
            full = (len(buf) - 1) // segment_size
            if full:
                sealed = []
                with memoryview(buf) as view:
                    for k in range(full):
                        with view[k * segment_size : (k + 1) * segment_size] as seg:
                            sealed.append(aead.encrypt(_nonce(index), seg, _aad(header, index, False)))
                        index += 1
                del buf[: full * segment_size]  # one move per piece, not one per segment
                yield from sealed
        yield aead.encrypt(_nonce(index), bytes(buf), _aad(header, index, True))
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # a producer thread behind `pieces` stops when the upload stops early


def seal_bytes(data: bytes | bytearray | memoryview, dek: bytes, *, segment_size: int = SEGMENT_SIZE) -> bytearray:
    """Seal a whole in-memory blob (a chunk of a few MiB), straight into one buffer (no copies)."""
    if not MIN_SEGMENT <= segment_size <= MAX_SEGMENT:
        raise InvalidArgument(f"segment size {segment_size} out of range")
    aead = AESGCM(dek)
    header = HEADER.pack(MAGIC, segment_size)
    n = max(1, -(-len(data) // segment_size))
    out = bytearray(sealed_size(len(data), segment_size))
    out[: HEADER.size] = header
    pos = HEADER.size
    with memoryview(data) as view, memoryview(out) as dst:
        for i in range(n):
            with view[i * segment_size : (i + 1) * segment_size] as seg:
                end = pos + len(seg) + TAG
                with dst[pos:end] as into:
                    aead.encrypt_into(_nonce(i), seg, _aad(header, i, i == n - 1), into)
                pos = end
    return out


def sealed_size(plain: int, segment_size: int = SEGMENT_SIZE) -> int:
    return HEADER.size + plain + TAG * max(1, -(-plain // segment_size))


def _read_header(header: bytes) -> int:
    if len(header) != HEADER.size:
        raise DecryptionFailed("sealed blob is shorter than its header", hint=_TAMPER_HINT)
    magic, size = HEADER.unpack(header)
    if magic != MAGIC:
        raise DecryptionFailed("blob is not sealed by kubectl-snapshot (bad magic)", hint=_TAMPER_HINT)
    if not MIN_SEGMENT <= size <= MAX_SEGMENT:
        raise DecryptionFailed(f"sealed blob declares segment size {size}", hint=_TAMPER_HINT)
    return int(size)


def _open(aead: AESGCM, header: bytes, index: int, final: bool, seg: bytes | memoryview) -> bytes:
    try:
        return aead.decrypt(_nonce(index), seg, _aad(header, index, final))
    except InvalidTag:
        raise DecryptionFailed(
            f"segment {index} of a sealed blob does not authenticate"
            + (" (truncated, reordered or altered)" if not final else " (altered or truncated)"),
            hint=_TAMPER_HINT,
        ) from None


_Blob = bytes | bytearray | memoryview


@overload
def open_bytes(blob: _Blob, dek: bytes, *, into: None = None) -> bytearray: ...
@overload
def open_bytes(blob: _Blob, dek: bytes, *, into: bytearray) -> memoryview: ...
def open_bytes(blob: _Blob, dek: bytes, *, into: bytearray | None = None) -> bytearray | memoryview:
    """Decrypt a whole sealed blob; every segment authenticated, the last one as final.

    `into`: a scratch buffer to decrypt into (grown when too small; it must have no views then): the
    result is a view of its first bytes, to be released before the buffer is used again. A chunk
    worker keeps one, so that every chunk does not cost a new zero-filled, page-faulted buffer."""
    with memoryview(blob) as whole:
        header = bytes(whole[: HEADER.size])
        size = _read_header(header)
        aead = AESGCM(dek)
        body = whole[HEADER.size :]
        step = size + TAG
        n = max(1, -(-len(body) // step))
        if len(body) - (n - 1) * step < TAG:
            raise DecryptionFailed("sealed blob ends inside a segment tag", hint=_TAMPER_HINT)
        length = len(body) - n * TAG
        if into is None:
            out: bytearray | memoryview = bytearray(length)
        else:
            if len(into) < length:
                into.extend(bytes(length - len(into)))
            out = memoryview(into)[:length]
        try:
            with memoryview(out) as dst:
                for i in range(n):
                    with body[i * step : (i + 1) * step] as seg, dst[i * size : i * size + len(seg) - TAG] as part:
                        try:
                            aead.decrypt_into(_nonce(i), seg, _aad(header, i, i == n - 1), part)
                        except InvalidTag:
                            raise DecryptionFailed(
                                f"segment {i} of a sealed blob does not authenticate"
                                + (" (truncated, reordered or altered)" if i < n - 1 else " (altered or truncated)"),
                                hint=_TAMPER_HINT,
                            ) from None
        except BaseException:
            if isinstance(out, memoryview):
                out.release()  # the scratch buffer stays usable (and growable) for the next blob
            raise
        body.release()
    return out


class OpeningReader:
    """A read-only stream of the plaintext of a sealed blob in `raw` (segment by segment, one segment of
    look-ahead to know which is the last). Every byte it returns has been authenticated."""

    def __init__(self, raw: BinaryIO, dek: bytes) -> None:
        self._raw = raw
        self._header = _read_exact(raw, HEADER.size)
        self._size = _read_header(self._header)
        self._aead = AESGCM(dek)
        self._index = 0
        self._next = _read_exact(raw, self._size + TAG)
        self._buf = b""
        self._pos = 0
        self._done = False

    def _fill(self) -> None:
        cur = self._next
        if len(cur) < TAG:
            raise DecryptionFailed("sealed blob ends inside a segment tag", hint=_TAMPER_HINT)
        final = len(cur) < self._size + TAG
        if not final:
            self._next = _read_exact(self._raw, self._size + TAG)
            final = not self._next
        self._buf = _open(self._aead, self._header, self._index, final, cur)
        self._pos = 0
        self._index += 1
        self._done = final

    def read(self, n: int = -1) -> bytes:
        parts = []
        while n != 0:
            if self._pos >= len(self._buf):
                if self._done:
                    break
                self._fill()
                continue
            take = len(self._buf) - self._pos if n < 0 else min(n, len(self._buf) - self._pos)
            parts.append(self._buf[self._pos : self._pos + take])
            self._pos += take
            if n > 0:
                n -= take
        return b"".join(parts)

    def readable(self) -> bool:
        return True


def _read_exact(f: BinaryIO, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = f.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


# --- per snapshot ------------------------------------------------------------------------------------


def wrap_aad(namespace: str, digest: str) -> bytes:
    return _WRAP_LABEL + namespace.encode() + b"\x00" + digest.encode()


def wrapped_blob(aad: bytes) -> tuple[str, str] | None:
    """(namespace, blob digest) a data key's wrap names in its AAD; None for any other AAD."""
    if not aad.startswith(_WRAP_LABEL):
        return None
    namespace, sep, digest = aad[len(_WRAP_LABEL) :].partition(b"\x00")
    if not sep:
        return None
    try:
        return namespace.decode(), digest.decode()
    except UnicodeDecodeError:
        return None


def _sha256(data: bytes | bytearray | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Sealer:
    """Seals the blobs of one snapshot for `namespace` and collects their data keys, wrapped together when
    the config's record is made (`info`: one round trip per `WRAP_BATCH` keys where the key is remote)."""

    def __init__(self, key: NamespaceKey, namespace: str, *, segment_size: int = SEGMENT_SIZE) -> None:
        self.key, self.namespace, self.segment_size = key, namespace, segment_size
        self._lock = threading.Lock()
        self._deks: dict[str, bytes] = {}
        self._keys: dict[str, str] = {}  # wrapped, base64

    def seal_chunk(self, plain: bytes | bytearray, seed: bytes | None = None) -> tuple[bytearray, str]:
        """(ciphertext, its digest) of a chunk; same plaintext in the same namespace -> same ciphertext.
        `seed`: what the data key derives from, by default the plaintext's sha256; a caller that passes
        another one promises that it is collision resistant and determines `plain` (two different
        plaintexts under one seed would share a key and its nonces)."""
        dek = self._chunk_key(seed or hashlib.sha256(plain).digest())
        sealed = seal_bytes(plain, dek, segment_size=self.segment_size)
        digest = _sha256(sealed)
        self._record(digest, dek)
        return sealed, digest

    def record_chunk(self, digest: str, seed: bytes) -> None:
        """Name a chunk sealed by an earlier snapshot (a page delta's base, reused unread): its data key
        follows from the seed it was sealed with (convergent), so it can be wrapped again for this config."""
        self._record(digest, self._chunk_key(seed))

    def _chunk_key(self, seed: bytes) -> bytes:
        return self.key.mac(_CHUNK_LABEL + seed)

    def stream_key(self) -> bytes:
        """A fresh random data key for one layer; give it to `seal_stream`, then `record` the digest."""
        return new_key()

    def seal_stream(self, pieces: Iterable[bytes], dek: bytes) -> Iterator[bytes]:
        return seal_stream(pieces, dek, segment_size=self.segment_size)

    def record(self, digest: str, dek: bytes) -> None:
        self._record(digest, dek)

    def _record(self, digest: str, dek: bytes) -> None:
        with self._lock:
            self._deks.setdefault(digest, dek)

    def info(self, digests: Iterable[str]) -> EncryptionInfo:
        """The config record for the blobs named by `digests` (each must have been sealed here); their data
        keys are wrapped now, `WRAP_BATCH` to a call."""
        names = list(dict.fromkeys(digests))
        with self._lock:
            todo = [(d, self._deks[d]) for d in names if d not in self._keys]
        for i in range(0, len(todo), WRAP_BATCH):
            batch = todo[i : i + WRAP_BATCH]
            wrapped = self.key.wrap_many([(dek, wrap_aad(self.namespace, d)) for d, dek in batch])
            if len(wrapped) != len(batch):
                raise FailedPrecondition(f"asked to wrap {len(batch)} data keys, got {len(wrapped)}")
            with self._lock:
                for (d, _), w in zip(batch, wrapped, strict=True):
                    self._keys.setdefault(d, base64.b64encode(w).decode())
        with self._lock:
            keys = {d: self._keys[d] for d in names}
        return EncryptionInfo(SCHEME, self.namespace, self.key.key_id, keys)


class Opener:
    """Unwraps the data keys of one snapshot with its namespace key; opens its blobs. The first key asked
    for unwraps them all (`WRAP_BATCH` to a call: one round trip each where the key is remote); when that
    fails, each is unwrapped on its own, so the error names the blob."""

    def __init__(self, info: EncryptionInfo, key: NamespaceKey) -> None:
        self.info, self.key = info, key
        self._lock = threading.Lock()
        self._deks: dict[str, bytes] | None = None

    def data_key(self, digest: str) -> bytes:
        with self._lock:
            if self._deks is None:
                self._deks = self._unwrap_all()
            dek = self._deks.get(digest)
        return dek if dek is not None else self._unwrap(digest)

    def _unwrap_all(self) -> dict[str, bytes]:
        """Every listed key that opens in batches ({} when one batch fails: each is then asked on its own)."""
        try:
            items = [(d, base64.b64decode(w, validate=True)) for d, w in self.info.keys.items()]
        except ValueError:
            return {}
        out: dict[str, bytes] = {}
        for i in range(0, len(items), WRAP_BATCH):
            batch = items[i : i + WRAP_BATCH]
            try:
                deks = self.key.unwrap_many([(w, wrap_aad(self.info.namespace, d)) for d, w in batch])
            except DecryptionFailed:
                return {}
            if len(deks) != len(batch):
                return {}
            out.update(zip((d for d, _ in batch), deks, strict=True))
        return out

    def _unwrap(self, digest: str) -> bytes:
        wrapped = self.info.keys.get(digest)
        if wrapped is None:
            raise DecryptionFailed(f"snapshot config has no data key for blob {digest}", hint=_TAMPER_HINT)
        try:
            raw = base64.b64decode(wrapped, validate=True)
        except ValueError:
            raise DecryptionFailed(f"the data key of blob {digest} is not base64", hint=_TAMPER_HINT) from None
        try:
            return self.key.unwrap(raw, wrap_aad(self.info.namespace, digest))
        except DecryptionFailed as e:
            raise DecryptionFailed(
                f"cannot decrypt blob {digest}: {e.message} (snapshot sealed for namespace "
                f"{self.info.namespace!r}, key {self.info.key_id})",
                hint=e.hint,
            ) from None

    @overload
    def open_chunk(self, digest: str, sealed: _Blob, *, into: None = None) -> bytearray: ...
    @overload
    def open_chunk(self, digest: str, sealed: _Blob, *, into: bytearray) -> memoryview: ...
    def open_chunk(self, digest: str, sealed: _Blob, *, into: bytearray | None = None) -> bytearray | memoryview:
        try:
            return open_bytes(sealed, self.data_key(digest), into=into)
        except DecryptionFailed as e:
            if e.message.startswith("cannot decrypt"):
                raise
            raise DecryptionFailed(f"blob {digest}: {e.message}", hint=e.hint) from None

    def reader(self, digest: str, raw: BinaryIO) -> OpeningReader:
        return OpeningReader(raw, self.data_key(digest))
