"""Package a dumped container (and the volumes) straight into the registry, as format v2 blobs.

A container becomes one small tar+zstd layer (CRIU's metadata images, the rootfs diff, the
checkpointctl files) plus its page files as content-addressed chunks (core/chunks.py); both are
streamed (shim/engine/stream.py): nothing is copied to disk a second time, compression uses both
cores, and a chunk the registry already has (from an earlier snapshot in the same repository) is not
sent again.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.chunks import PagesFile
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import Sealer
from shim.engine.chunks import plan_checkpoint
from shim.engine.node_ports import Registry
from shim.engine.pageindex import PageIndex
from shim.engine.stream import push_chunks, push_file_stream, push_tar_stream

CountFn = Callable[[int], None]


@dataclass(frozen=True)
class PackagedBlob:
    digest: str
    size: int  # compressed bytes stored


@dataclass(frozen=True)
class PackagedContainer:
    layer: PackagedBlob
    pages: tuple[PagesFile, ...]
    stored: int  # compressed bytes of the layer and all its chunks
    uploaded: int  # bytes actually sent (the layer always; chunks only when the registry lacked them)


def progress_counter(on_bytes: Callable[[int, int], None] | None, total: int) -> CountFn | None:
    """A thread-safe (new bytes) callback feeding on_bytes(new, total) (workers report concurrently)."""
    if on_bytes is None:
        return None
    lock = threading.Lock()

    def add(n: int) -> None:
        with lock:
            on_bytes(n, total)

    return add


def tree_bytes(path: str) -> int:
    """Bytes of regular files below `path` (the raw size a progress bar counts towards)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def package_container(
    registry: Registry,
    ref: Reference,
    cdir: str,
    *,
    on_raw: CountFn | None = None,
    sealer: Sealer | None = None,
    index: PageIndex | None = None,
) -> PackagedContainer:
    """Upload the container dump in `cdir` (checkpointctl layout): its page chunks and, beside them, its layer.

    With `sealer` every blob is encrypted before it is hashed and sent (core/sealing.py). With `index`
    (this pod's bases for this container and repository, shim/engine/pageindex.py) chunks that changed a little
    are stored as page deltas, and the index is saved with this snapshot's bases once they are sent."""
    plans = plan_checkpoint(os.path.join(cdir, C.CHECKPOINT_DIRECTORY))
    exclude = [f"{C.CHECKPOINT_DIRECTORY}/{p.name}" for p in plans]
    # The layer goes up beside the chunks: its registry round trips (upload start, data, commit) overlap
    # theirs instead of following them; a small pod's snapshot is a dozen or so blobs in all.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-push") as pool:
        layer = pool.submit(push_tar_stream, registry, ref, cdir, exclude=exclude, on_raw=on_raw, sealer=sealer)
        chunks = push_chunks(registry, ref, plans, on_raw=on_raw, sealer=sealer, index=index)
        if index is not None:
            index.save()
        digest, size = layer.result()
    return PackagedContainer(
        layer=PackagedBlob(digest, size),
        pages=chunks.files,
        stored=chunks.stored + size,
        uploaded=chunks.uploaded + size,
    )


def package_volumes(
    registry: Registry, ref: Reference, tar_path: str, *, on_raw: CountFn | None = None, sealer: Sealer | None = None
) -> PackagedBlob:
    """Upload the volumes tar captured while frozen as one zstd layer (streamed, not staged)."""
    digest, size = push_file_stream(registry, ref, tar_path, on_raw=on_raw, sealer=sealer)
    return PackagedBlob(digest, size)
