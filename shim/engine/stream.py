"""The streaming packaging pipeline: read -> compress -> hash -> upload, overlapped, bounded memory.

Why this shape: packaging, not CRIU, is the bottleneck (PLATFORM.md: zstd -1 and sha256 each run at
about the speed of a CRIU dump on one core). So after the workload is resumed:

* memory page chunks go through a thread pool; each worker reads its chunk with pread,
  compresses it (zstd releases the GIL), hashes it (hashlib releases the GIL) and uploads it unless the
  registry already has that digest (the incremental part). Both cores compress while sockets send;
  memory stays at about ``workers x 2 x chunk`` (``workers_for``: more workers for small chunks, whose
  cost is registry round trips), and nothing is written to disk a second time.
* the rest of a container's dump (small CRIU images, rootfs diff, metadata) is tarred straight into a
  zstd stream that is hashed and uploaded as it is produced (no layer file on disk).

Restore runs the same way backwards: chunks are downloaded by several workers, each verified against
its digest (and opened, when sealed) before it is decompressed, into buffers each worker keeps, and
written without its zero pages into the page file (shim/engine/pagewrite.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import BinaryIO, TypeVar, cast

import zstandard

from kubectl_snapshot.core.chunks import PAGE_SIZE, Chunk, Delta, PagesFile, delta_raw_length
from kubectl_snapshot.core.errors import DigestMismatch, UnsafeArchive
from kubectl_snapshot.core.pagedelta import apply_delta, encode_delta, plan_delta, worth_a_delta
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import Opener, Sealer
from shim.engine.chunks import PagesPlan
from shim.engine.node_ports import Registry
from shim.engine.pageindex import BaseChunk, PageIndex
from shim.engine.pagewrite import Into, decompress_into, nonzero_runs, share_runs, write_runs
from shim.files.archive import tar_directory
from shim.files.pipes import iter_produced
from shim.files.zstdio import open_zstd_writer

ZSTD_LEVEL = 1  # the fastest useful level (PLATFORM.md)
WORKERS = max(2, min(8, 2 * (os.cpu_count() or 1)))  # I/O waits overlap with the other workers' CPU
# Small chunks are bound by registry round trips (HEAD, POST, PUT: tens of ms each on a busy registry),
# not by CPU: more of them in flight, as long as the chunks held in memory stay within this budget.
MAX_IO_WORKERS = 16
CHUNK_MEMORY_BUDGET = 128 << 20


def workers_for(chunk_bytes: int) -> int:
    """How many chunks to handle at once when the largest is `chunk_bytes` (raw + compressed each)."""
    by_memory = CHUNK_MEMORY_BUDGET // max(1, 2 * chunk_bytes)
    return max(WORKERS, min(MAX_IO_WORKERS, by_memory))


_HINT = "the registry's storage is corrupt or the content was tampered with; it was not used"

CountFn = Callable[[int], None]
J = TypeVar("J")
R = TypeVar("R")


@dataclass(frozen=True)
class PushedChunks:
    files: tuple[PagesFile, ...]
    stored: int  # compressed bytes of all chunks (what the snapshot needs)
    uploaded: int  # compressed bytes actually sent (chunks the registry lacked)
    raw: int  # uncompressed bytes


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)
    return c


def run_parallel(fn: Callable[[J], R], jobs: Sequence[J], *, workers: int, name: str) -> list[R]:
    """fn over jobs on a thread pool, results in job order; the first failure cancels what has not
    started and is raised once the running jobs are done."""
    n = max(1, min(workers, len(jobs)))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix=name) as pool:
        # Every worker thread is started before any job runs: the pool starts a thread per submit and
        # waits for it to run, which, once jobs hold the GIL (page hashing), took ~10 ms per thread
        # (190 ms of a 64 MiB checkpoint's packaging in a profile)
        go = threading.Event()
        for _ in range(n):
            pool.submit(go.wait)
        go.set()
        futures = [pool.submit(fn, j) for j in jobs]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def push_chunks(
    registry: Registry,
    ref: Reference,
    plans: Sequence[PagesPlan],
    *,
    workers: int | None = None,
    on_raw: CountFn | None = None,
    sealer: Sealer | None = None,
    index: PageIndex | None = None,
) -> PushedChunks:
    """Compress, hash and upload every planned chunk (in parallel); returns the chunk records.

    With `sealer` each compressed chunk is sealed (convergent key: the same content in the same
    namespace gives the same blob, so the registry still has it) and the digest is the ciphertext's.
    With `index` (the node's bases for this pod's container and repository, shim/engine/pageindex.py)
    every page of a chunk is hashed (keyed by the node's key); a chunk whose base the registry still
    has and from which few enough of its pages differ (core/pagedelta.worth_a_delta) is stored as that
    base plus a page delta (none at all when no page differs: then nothing is compressed either); the
    index collects this snapshot's bases.
    """
    uploaded, stored = _Counter(), _Counter()
    fds = {p.name: os.open(p.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC) for p in plans}

    def seal(packed: bytes, seed: bytes) -> tuple[bytes | bytearray, str]:
        if sealer is not None:
            return sealer.seal_chunk(packed, seed)
        return packed, "sha256:" + seed.hex()

    def send(blob: bytes | bytearray, digest: str, *, fresh: bool = False) -> None:
        if registry.push_blob(ref, digest=digest, size=len(blob), data=blob, fresh=fresh):
            uploaded.add(len(blob))
        stored.add(len(blob))

    def as_delta(raw: bytes, offset: int, base: BaseChunk, layout: bytes, hashes: bytes) -> Chunk | None:
        plan = plan_delta(base.layout, base.hashes, layout, hashes)
        if plan is None:
            return None
        fresh = None
        if not plan.identical:
            if base.last is not None:
                since_last = plan_delta(*base.last, layout, hashes)
                fresh = None if since_last is None else len(since_last.literals)
            if not worth_a_delta(len(plan.literals), plan.pages, fresh):
                return None
        if not registry.blob_exists(ref, base.digest):
            return None  # retention or GC removed it: store the chunk whole
        if sealer is not None:
            sealer.record_chunk(base.digest, base.seed)
        stored.add(base.size)
        if plan.identical:
            return Chunk(offset, len(raw), base.digest, base.size)
        packed = _compressor().compress(encode_delta(raw, plan))
        blob, digest = seal(packed, hashlib.sha256(packed).digest())
        # a chunk that changed since the last save: its delta is new, no registry has that blob yet (a
        # retried save's is only sent again), so no lookup first. One that did not (fresh == 0) makes
        # the very delta the last save stored: asked for first, it is not sent again
        send(blob, digest, fresh=fresh != 0)
        delta = Delta(digest, len(blob), len(plan.literals), len(plan.copies), base.length)
        return Chunk(offset, len(raw), base.digest, base.size, delta)

    try:

        def one(job: tuple[str, int, int, tuple[tuple[str, ...], bytes]]) -> Chunk:
            name, offset, length, (keys, layout) = job
            raw = os.pread(fds[name], length, offset)
            if len(raw) != length:
                raise OSError(f"{name} shrank while it was being packaged")
            hashing = index is not None and bool(keys) and length % PAGE_SIZE == 0
            hashes = index.page_hashes(raw) if index is not None and hashing else None
            key = keys[0] if keys else ""
            if index is not None and hashes is not None:
                # the base of the same address range: found by the first page's window, or another
                # window the chunk covers (its first pages may be new, or pieces merged differently)
                tried: set[str] = set()
                for base in filter(None, map(index.get, keys)):
                    if base.digest in tried:
                        continue
                    tried.add(base.digest)
                    chunk = as_delta(raw, offset, base, layout, hashes)
                    if chunk is not None:  # still the base (deltas never chain); remember this version too
                        last = (layout, hashes) if chunk.delta is not None else None
                        index.put(key, replace(base, last=last), also=keys[1:])
                        if on_raw is not None:
                            on_raw(length)
                        return chunk
            packed = _compressor().compress(raw)
            # in clear the blob's digest; sealed, what its convergent data key derives from
            seed = hashlib.sha256(packed).digest()
            blob, digest = seal(packed, seed)
            send(blob, digest)
            if index is not None and hashes is not None:
                index.put(key, BaseChunk(digest, len(blob), length, seed, hashes, layout), also=keys[1:])
            if on_raw is not None:
                on_raw(length)
            return Chunk(offset, length, digest, len(blob))

        jobs = [(p.name, s.offset, s.length, p.layout(i)) for p in plans for i, s in enumerate(p.spans)]
        n = workers or workers_for(max((job[2] for job in jobs), default=0))
        results = run_parallel(one, jobs, workers=n, name="chunk-push")
    finally:
        for fd in fds.values():
            os.close(fd)
    files, i = [], 0
    for p in plans:
        files.append(PagesFile(p.name, p.size, tuple(results[i : i + len(p.spans)])))
        i += len(p.spans)
    return PushedChunks(tuple(files), stored.value, uploaded.value, sum(p.size for p in plans))


class _Counting:
    def __init__(self, inner: BinaryIO, on_raw: CountFn | None) -> None:
        self._inner, self._on_raw = inner, on_raw
        self.size = 0

    def write(self, data: bytes, /) -> int:
        self.size += len(data)
        if self._on_raw is not None:
            self._on_raw(len(data))
        return self._inner.write(data)


def push_tar_stream(
    registry: Registry,
    ref: Reference,
    src: str,
    *,
    exclude: Iterable[str] = (),
    on_raw: CountFn | None = None,
    sealer: Sealer | None = None,
) -> tuple[str, int]:
    """tar `src` (minus the relative paths in `exclude`) -> zstd -> sha256 -> upload, as one stream.

    Returns (digest, compressed size). Nothing touches the disk; the producer thread and zstd's
    workers run while the upload sends.
    """
    skip = set(exclude)

    def produce(out: BinaryIO) -> None:
        with open_zstd_writer(out, level=ZSTD_LEVEL, threads=-1) as zw:
            tar_directory(
                src,
                _Counting(zw, on_raw),
                on_entry=(lambda path, _st, _fd: path not in skip) if skip else None,
                exact_mtimes=False,  # CRIU's images and the agent's files: their times are nobody's state
            )

    return _push_produced(registry, ref, produce, sealer)


def _push_produced(
    registry: Registry, ref: Reference, produce: Callable[[BinaryIO], None], sealer: Sealer | None
) -> tuple[str, int]:
    """Upload what `produce` writes, sealed segment by segment under a fresh data key with `sealer`."""
    if sealer is None:
        return registry.push_blob_stream(ref, iter_produced(produce))
    dek = sealer.stream_key()
    digest, size = registry.push_blob_stream(ref, sealer.seal_stream(iter_produced(produce), dek))
    sealer.record(digest, dek)
    return digest, size


def push_file_stream(
    registry: Registry, ref: Reference, path: str, *, on_raw: CountFn | None = None, sealer: Sealer | None = None
) -> tuple[str, int]:
    """zstd -> sha256 -> upload of an existing (tar) file, as one stream."""

    def produce(out: BinaryIO) -> None:
        with open(path, "rb") as f, open_zstd_writer(out, level=ZSTD_LEVEL, threads=-1) as zw:
            while piece := f.read(1 << 20):
                zw.write(piece)
                if on_raw is not None:
                    on_raw(len(piece))

    return _push_produced(registry, ref, produce, sealer)


def fetch_chunks(
    registry: Registry,
    ref: Reference,
    files: Sequence[PagesFile],
    checkpoint_dir: str,
    *,
    workers: int | None = None,
    on_bytes: CountFn | None = None,
    opener: Opener | None = None,
    cancelled: threading.Event | None = None,
) -> int:
    """Recreate each page file in `checkpoint_dir` (an existing directory, not a symlink) from its
    chunks; returns the compressed bytes downloaded. Once `cancelled` is set, no further chunk is
    begun (FetchCancelled is raised).

    Each chunk is downloaded whole (a few MiB at most), verified against its digest and size by the
    registry client, decrypted (`opener`: every segment authenticated) and decompressed and checked to
    be exactly its recorded length, and only then written: its zero pages left as holes, each of its other
    places cloned from the first (shim/engine/pagewrite.py). A chunk with a page delta (format v4) is its
    base chunk (so verified) with the pages of its delta blob (verified the same way, and its page
    list checked by core/pagedelta.apply_delta) put in. A file that already exists is refused (the
    layer must not also carry it).
    """
    dfd = os.open(checkpoint_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    fds: dict[str, int] = {}
    total = _Counter()
    try:
        for f in files:
            try:
                fd = os.open(
                    f.name,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,  # read: a shared chunk's source
                    0o600,
                    dir_fd=dfd,
                )
            except FileExistsError:
                raise UnsafeArchive(
                    f"{f.name} is both in the container layer and stored as chunks",
                    hint="the snapshot is corrupted or was crafted; do not restore it",
                ) from None
            fds[f.name] = fd
            os.ftruncate(fd, f.size)  # every page reads as zero until a chunk writes it

        def scratch(name: str) -> bytearray:
            """This worker's buffer `name`, kept from chunk to chunk (no fresh page-faulted memory each)."""
            buf = getattr(_local, name, None)
            if buf is None:
                buf = bytearray()
                setattr(_local, name, buf)
            return buf

        def one(job: tuple[Chunk, list[tuple[str, int]]]) -> None:
            if cancelled is not None and cancelled.is_set():
                raise FetchCancelled("the restore's staging stopped")
            c, places = job  # c: the chunk at its first place
            name = places[0][0]
            raw = chunk_content(registry, ref, c, what=name, opener=opener, buffer=scratch)
            runs = nonzero_runs(raw, c.length)
            with memoryview(raw) as view:
                write_runs(fds[name], view, runs, c.offset)
                for other, offset in places[1:]:
                    share_runs(fds[name], c.offset, fds[other], offset, view, runs)
            got = c.size + (c.delta.size if c.delta is not None else 0)
            total.add(got)  # downloaded once
            if on_bytes is not None:
                on_bytes(got * len(places))  # the plan counts every use (restore.plan_space)

        run_parallel(one, list(_unique_chunks(files)), workers=workers or fetch_workers(files), name="chunk-fetch")
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(dfd)
    return total.value


def chunk_content(
    registry: Registry,
    ref: Reference,
    c: Chunk,
    *,
    what: str,
    opener: Opener | None = None,
    buffer: Callable[[str], bytearray] = lambda _name: bytearray(),
) -> bytes | bytearray:
    """One chunk's pages, `c.length` bytes (what a buffer holds past them is not the chunk's): its blob
    downloaded whole, verified (digest, size), opened (`opener`: every segment authenticated) and
    decompressed to exactly its recorded length; with a page delta (format v4), its base so made and the
    delta's pages put in (core/pagedelta.apply_delta checks its page list). `buffer(name)` gives the
    scratch buffers ("raw", "fetched", "opened") a caller keeps from chunk to chunk; fresh ones by
    default. Staging writes the result to the page file (fetch_chunks); a lazy restore serves pages from
    it (shim/engine/lazysource.py)."""

    def blob_into(digest: str, size: int, raw_length: int, kind: str, out: bytearray) -> None:
        fetched = Into(buffer("fetched"), size)
        registry.fetch_blob(ref, digest, cast(BinaryIO, fetched), expected_size=size, max_size=size)
        with fetched.view() as sealed:
            if opener is None:
                got = _decompressed(sealed, out, raw_length, kind, digest)
            else:  # decrypted into the scratch buffer, every segment authenticated first
                with opener.open_chunk(digest, sealed, into=buffer("opened")) as blob:
                    got = _decompressed(blob, out, raw_length, kind, digest)
        if got != raw_length:
            held = f"more than {raw_length}" if got > raw_length else str(got)
            raise DigestMismatch(f"{kind} {digest} holds {held} bytes, the snapshot says {raw_length}", hint=_HINT)

    d = c.delta
    buf = buffer("raw")
    blob_into(c.digest, c.size, d.base_length if d else c.length, f"chunk of {what}", buf)
    if d is None:
        return buf
    delta = bytearray()
    blob_into(d.digest, d.size, delta_raw_length(d.pages, d.copies), f"page delta of {what}", delta)
    where = f"page delta {d.digest} of {what} (offset {c.offset})"
    with memoryview(buf)[: d.base_length] as base:
        return apply_delta(base, delta[: delta_raw_length(d.pages, d.copies)], length=c.length,
                           literals=d.pages, copies=d.copies, where=where)  # fmt: skip


def _decompressed(blob: memoryview, out: bytearray, raw_length: int, what: str, digest: str) -> int:
    try:
        return decompress_into(blob, out, raw_length)
    except zstandard.ZstdError as e:
        raise DigestMismatch(f"{what} {digest} does not decompress: {e}", hint=_HINT) from e


def fetch_workers(files: Sequence[PagesFile]) -> int:
    """How many chunks fetch_chunks handles at once for `files`."""
    # a chunk with a page delta holds its base, its delta and the rebuilt chunk at once
    return workers_for(max((_fetch_bytes(c) for f in files for c in f.chunks), default=0))


class FetchCancelled(Exception):
    """fetch_chunks stopped early on request (the rest of the staging failed)."""


def _unique_chunks(files: Sequence[PagesFile]) -> Iterable[tuple[Chunk, list[tuple[str, int]]]]:
    """Each distinct chunk content (the same blob, length and page delta) once, with every (page file,
    offset) it fills, in the order of first use: memory a forked worker shares with its parent, or
    repeated within one process, is downloaded, verified and opened once."""
    places: dict[tuple[str, int, int, Delta | None], tuple[Chunk, list[tuple[str, int]]]] = {}
    for f in files:
        for c in f.chunks:
            places.setdefault((c.digest, c.size, c.length, c.delta), (c, []))[1].append((f.name, c.offset))
    return places.values()


def _fetch_bytes(c: Chunk) -> int:
    """The chunk size one chunk's restore stands for in workers_for (which counts it twice: raw and
    compressed): with a delta, its base, the delta and the rebuilt chunk (a little more than needed)."""
    if c.delta is None:
        return c.length
    return c.length + c.delta.base_length + delta_raw_length(c.delta.pages, c.delta.copies)
