"""The node's memory of the last full chunk of each address range, for page deltas (format v4).

Per scope (one pod, or one container outside Kubernetes; one of its containers; one snapshot
repository; the sealing key, or none: scope_key) one file in the agent's state directory lists, for
every chunk the last snapshot of that scope stored or reused as a base: its layout key (the first
address window it covers, shim/engine/chunks.window_keys; the other windows it covers are aliases of
it, so a chunk cut differently next time still finds it), the base blob's digest and size, the seed
its data key derives from when sealed (core/sealing.Sealer.seal_chunk), a keyed hash of each of its
pages (core/pagedelta.page_hashes) and, when that snapshot stored the chunk as a delta, the page
hashes of that version too (what changed since the last snapshot decides whether a large delta is
worth sending, core/pagedelta.worth_a_delta). The next snapshot of the scope compares page hashes and
uploads only the pages that changed.

Why one pod per scope: a page whose hash matches is not sent, and the restore takes it from the base.
Pods that shared bases (every pod of a policy saving into one repository, one container name) would
let one pod's pages stand in another pod's snapshot wherever the hashes agree; the pod is the unit a
tenant controls, so nothing of one pod's memory is ever compared with another's. A pod that replaces
another (a resumed pod, a StatefulSet's next pod of the same name) has a new uid and so no base: its
first save stores its chunks whole, which is always correct (unchanged chunks still cost nothing to
send: the registry has their blobs by digest). A pod name is not used instead: it can be taken again
by another pod of the namespace, made by anyone who may create pods there.

Why a node key: the page hashes are keyed (core/pagedelta.page_hashes) by 32 random bytes the agent
makes on first use, kept in this directory (KEY_FILE, 0600; the directory 0700) and never put in a
snapshot or sent anywhere. Each index file names the key it was hashed with (an id derived from it);
a file hashed with another key (another node's, a key made again after its file was lost) or in an
older format (v2: unkeyed XXH3-128; v1: truncated sha256) is not read at all: full chunks once.

It is a cache and nothing more: a missing, unreadable, corrupt (checksum) or oversized file means full
chunks, never a failed or wrong snapshot; writes are atomic (temporary file + rename); the directory
keeps the most recently used scopes, at most MAX_FILES of them and at most the node's byte budget
(KUBECTL_SNAPSHOT_PAGE_INDEX_MIB, default DEFAULT_BUDGET_MIB: a scope's file is about 1/256 of its
container's memory, twice that with deltas, so the default covers some 128-256 GiB of saved memory
on a node); the scope just saved is always kept. A scope pruned away only means full chunks at its
next save. A base is used only after the registry confirms that the target repository still has its
blob.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import blake3

from kubectl_snapshot.core.chunks import PAGE_SIZE
from kubectl_snapshot.core.oci import is_digest
from kubectl_snapshot.core.pagedelta import PAGE_HASH_KEY_BYTES, page_hashes

# v3: page hashes are BLAKE3 keyed by the node's key, named in the file. Older files (v2: unkeyed
# XXH3-128, v1: truncated sha256) are not read: their hashes would be compared with another function
MAGIC = b"KSPIDX3\n"
KEY_FILE = "page-hash.key"
MAX_FILE_BYTES = 128 << 20  # page hashes are 1/256 of the memory (twice for deltas): 16 GiB containers
MAX_FILES = 256
ENV_BUDGET_MIB = "KUBECTL_SNAPSHOT_PAGE_INDEX_MIB"
DEFAULT_BUDGET_MIB = 1024
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class BaseChunk:
    digest: str  # the stored blob (ciphertext when sealed)
    size: int
    length: int  # raw bytes of the chunk
    # what a sealed chunk's data key derives from (core/sealing.Sealer.seal_chunk): the sha256 of the
    # compressed chunk
    seed: bytes
    hashes: bytes  # PAGE_HASH_BYTES per page
    layout: bytes  # which virtual addresses its pages hold (core/chunks.span_layouts)
    # the last snapshot's version of the chunk (layout, page hashes) when it was base + a delta
    last: tuple[bytes, bytes] | None = None


def scope_key(registry: str, repository: str, owner: str, container: str, key_id: str | None) -> str:
    """The index file of one container of one `owner` (a pod's uid; outside Kubernetes the containerd
    namespace and container id) saved into one repository, clear or sealed by one key."""
    raw = "\0".join((registry, repository, owner, container, key_id or "clear"))
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def key_id(key: bytes) -> str:
    """Names a page hash key in an index file without revealing it."""
    return blake3.blake3(b"kubectl-snapshot page index key id", key=key).hexdigest(16)


def node_key(directory: str) -> bytes:
    """The node's page hash key, made (32 random bytes, 0600) on first use. A key file that is not
    exactly that (damaged, a link) is replaced: every index is then read as empty once."""
    path = os.path.join(directory, KEY_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    except OSError:  # ELOOP: a link is no key of ours
        return _new_key(path, replace=True)
    else:
        with os.fdopen(fd, "rb") as f:
            key = f.read(PAGE_HASH_KEY_BYTES + 1)
        if len(key) == PAGE_HASH_KEY_BYTES:
            return key
        return _new_key(path, replace=True)
    return _new_key(path, replace=False)


def _new_key(path: str, *, replace: bool) -> bytes:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    key = os.urandom(PAGE_HASH_KEY_BYTES)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        if replace:
            os.replace(tmp, path)
            return key
        try:
            os.link(tmp, path)  # create-if-absent: saves starting at once agree on one key
        except FileExistsError:
            return node_key(os.path.dirname(path))
        return key
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


class PageIndex:
    """The bases of one scope: read once before a snapshot's chunks, written once after them. `key`: the
    node's page hash key (None: no index could be had, so no page is hashed and nothing is kept)."""

    def __init__(
        self,
        path: str | None,
        entries: dict[str, BaseChunk] | None = None,
        aliases: dict[str, str] | None = None,
        *,
        key: bytes | None,
    ) -> None:
        self.path = path if key is not None else None
        self.key = key
        self._old = dict(entries or {})
        self._old_aliases = dict(aliases or {})
        self._new: dict[str, BaseChunk] = {}
        self._new_aliases: dict[str, str] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, directory: str, scope: str) -> PageIndex:
        try:
            key = node_key(directory)
        except OSError:
            return cls(None, key=None)  # no key, no index: full chunks, the save goes on
        path = os.path.join(directory, scope + ".idx")
        try:
            entries, aliases = _read(path, key)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
            entries, aliases = {}, {}  # a cache: anything wrong with it means full chunks this time
        return cls(path, entries, aliases, key=key)

    def page_hashes(self, raw: bytes | bytearray | memoryview) -> bytes | None:
        """The keyed hashes of a chunk's pages (core/pagedelta.page_hashes); None without a key."""
        return None if self.key is None else page_hashes(raw, self.key)

    def get(self, layout: str) -> BaseChunk | None:
        """The base stored under this window key, or under the chunk that also covered this window."""
        base = self._old.get(layout)
        if base is None and layout in self._old_aliases:
            base = self._old.get(self._old_aliases[layout])
        return base

    def put(self, layout: str, base: BaseChunk, also: Iterable[str] = ()) -> None:
        """Keep `base` under the chunk's first window key `layout`, and findable by the other windows
        the chunk covers (`also`): a later chunk cut differently (a few pages more in front of the
        range make a small chunk of the first window) still finds its base by a window it shares."""
        with self._lock:
            self._new[layout] = base
            for k in also:
                self._new_aliases.setdefault(k, layout)

    def __len__(self) -> int:
        return len(self._old)

    def save(self) -> None:
        """Keep this snapshot's bases (and only those) for the next one; never raises."""
        if self.path is None or self.key is None:
            return
        with contextlib.suppress(OSError, ValueError):
            _write(self.path, self._new, self._new_aliases, self.key)
            _prune(os.path.dirname(self.path), keep=os.path.basename(self.path))


def _read(path: str, hash_key: bytes) -> tuple[dict[str, BaseChunk], dict[str, str]]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a page index")
    body = data[len(MAGIC) + 32 :]
    if hashlib.sha256(body).digest() != data[len(MAGIC) : len(MAGIC) + 32]:
        raise ValueError("page index checksum mismatch")
    (n,) = _LEN.unpack_from(body, 0)
    meta = json.loads(body[_LEN.size : _LEN.size + n])
    if meta["key"] != key_id(hash_key):
        raise ValueError("page index hashed with another key")  # another node's, or a lost key's
    blob = body[_LEN.size + n :]
    out: dict[str, BaseChunk] = {}
    pos = 0
    for key, digest, size, length, seed, sizes in meta["entries"]:
        if not (isinstance(key, str) and is_digest(digest) and size > 0 and length > 0 and length % PAGE_SIZE == 0):
            raise ValueError("bad page index entry")
        if len(sizes) not in (2, 4) or any(not isinstance(n, int) or n < 0 for n in sizes):
            raise ValueError("bad page index entry")
        parts = []
        for n in sizes:
            parts.append(blob[pos : pos + n])
            pos += n
        if pos > len(blob):
            raise ValueError("page index is truncated")
        last = (parts[2], parts[3]) if len(parts) == 4 else None
        out[key] = BaseChunk(digest, int(size), int(length), bytes.fromhex(seed), parts[1], parts[0], last)
    if pos != len(blob):
        raise ValueError("page index has trailing bytes")
    aliases: dict[str, str] = {}
    for k, v in meta.get("aliases", {}).items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise ValueError("bad page index alias")
        if v in out and k not in out:
            aliases[k] = v
    return out, aliases


def _write(path: str, entries: dict[str, BaseChunk], aliases: dict[str, str] | None, hash_key: bytes) -> None:
    parts: list[bytes] = []
    entries_meta = []
    for k, b in entries.items():
        mine = [b.layout, b.hashes, *(b.last or ())]
        parts.extend(mine)
        entries_meta.append([k, b.digest, b.size, b.length, b.seed.hex(), [len(p) for p in mine]])
    # a window that is some chunk's first is found as that chunk's; only the others are aliases
    kept = {k: v for k, v in (aliases or {}).items() if v in entries and k not in entries}
    meta = {"key": key_id(hash_key), "entries": entries_meta, "aliases": kept}
    head = json.dumps(meta, separators=(",", ":")).encode()
    body = b"".join([_LEN.pack(len(head)), head, *parts])
    if len(body) + len(MAGIC) + 32 > MAX_FILE_BYTES:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # too big to keep: the old one would be stale
        return
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + hashlib.sha256(body).digest() + body)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def budget_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The node's byte budget for page indexes (a positive whole number of MiB; anything else: the default)."""
    raw = environ.get(ENV_BUDGET_MIB, "").strip()
    mib = int(raw) if raw.isdigit() and 0 < int(raw) <= 1 << 30 else DEFAULT_BUDGET_MIB
    return mib << 20


def _prune(directory: str, keep: str) -> None:
    """Keep `keep` and, newest first, the other scopes up to MAX_FILES files and the byte budget; the
    first that does not fit and every older one go."""
    files = []
    for name in os.listdir(directory):
        if name.endswith(".idx"):
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(os.path.join(directory, name), follow_symlinks=False)
                files.append((name != keep, -st.st_mtime, st.st_size, name))
    budget, count, used, full = budget_bytes(), 0, 0, False
    for not_kept, _age, size, name in sorted(files):
        count, used = count + 1, used + size
        full = full or (not_kept and (count > MAX_FILES or used > budget))
        if full:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
