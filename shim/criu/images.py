"""Read a CRIU image directory into a small summary: process tree, memory, dump timings, versions.

Used for ``inspect``, progress/size estimates and restore preflight. Decoding is done by pycriu
(Debian's python3-pycriu, linked into the venv by hack/setup-venv.sh; not on PyPI), imported lazily so
that the plugin works without it. Images may come from an untrusted snapshot: files are opened with
O_NOFOLLOW, sizes are capped, and any decoding failure is a FailedPrecondition naming the file.
Raw page data (``pages-*.img``) is never read, only its size.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import asdict, dataclass, field
from typing import Any

from kubectl_snapshot.core.constants import CHECKPOINT_DIRECTORY, DUMP_LOG_FILE, STATS_DUMP_FILE
from kubectl_snapshot.core.errors import FailedPrecondition

# pagemap entry flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2
MAX_IMAGE_BYTES = 256 << 20  # metadata images only; a larger one is not a real dump
_HINT_CORRUPT = "the checkpoint is incomplete or corrupted; take a new snapshot"
_VERSION_RE = re.compile(r"Version: (\d+\.\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    pgid: int
    sid: int
    comm: str
    threads: int


@dataclass(frozen=True)
class CheckpointSummary:
    """What a checkpoint holds. Byte counts are exact; times are CRIU's own, in microseconds."""

    processes: list[ProcessInfo]
    process_count: int
    pages_written: int  # from stats-dump when present, else counted in the pagemaps
    page_size: int
    memory_bytes: int  # pages present in the pagemaps * page size: what restore loads
    pages_file_bytes: int  # sum of pages-*.img sizes (equals memory_bytes for a complete plain dump)
    vma_bytes: int  # sum of all VMA sizes (virtual size of every process)
    freezing_time_us: int | None = None
    frozen_time_us: int | None = None
    memdump_time_us: int | None = None
    memwrite_time_us: int | None = None
    criu_version: str | None = None  # from dump.log when present
    img_version: int | None = None  # from inventory.img
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable dict (processes as a list of dicts)."""
        return asdict(self)


def _pycriu_images() -> Any:
    try:
        import pycriu.images as images
    except ImportError as e:
        raise FailedPrecondition(
            "cannot read CRIU images: the pycriu module is not importable",
            hint="run hack/install-node-deps.sh (installs python3-pycriu) and then hack/setup-venv.sh "
            "(links it into the venv)",
        ) from e
    return images


def _open_nofollow(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise FailedPrecondition(f"checkpoint is missing {os.path.basename(path)} ({path})", hint=_HINT_CORRUPT) from e
    except OSError as e:
        raise FailedPrecondition(f"cannot open CRIU image {path}: {e.strerror}", hint=_HINT_CORRUPT) from e


def _load(images: Any, path: str) -> list[dict[str, Any]]:
    """Decoded entries of one CRIU image file."""
    fd = _open_nofollow(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_IMAGE_BYTES:
            raise FailedPrecondition(f"CRIU image {path} is {size} bytes, too large to be metadata")
        try:
            img = images.load(f)
            entries = img["entries"]
            if not isinstance(entries, list):
                raise TypeError("entries is not a list")
            return entries
        except FailedPrecondition:
            raise
        except Exception as e:  # pycriu raises many kinds on bad input (magic, protobuf, struct)
            raise FailedPrecondition(
                f"cannot decode CRIU image {path}: {type(e).__name__}: {e}", hint=_HINT_CORRUPT
            ) from e


def _int(entry: dict[str, Any], key: str, path: str) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise FailedPrecondition(f"CRIU image {path}: field {key!r} is missing or not an integer")
    return value


def _sibling(checkpoint_dir: str, name: str) -> str | None:
    """`name` in the image dir, or at the archive root (containerd/CRI-O put stats-dump, dump.log there)."""
    candidates = [os.path.join(checkpoint_dir, name)]
    if os.path.basename(os.path.normpath(checkpoint_dir)) == CHECKPOINT_DIRECTORY:
        candidates.append(os.path.join(os.path.dirname(os.path.normpath(checkpoint_dir)), name))
    for path in candidates:
        if os.path.lexists(path):
            return path
    return None


def _criu_version(log_path: str | None) -> str | None:
    if log_path is None:
        return None
    fd = _open_nofollow(log_path)
    with os.fdopen(fd, "rb") as f:
        head = f.read(64 << 10).decode("utf-8", "replace")
    m = _VERSION_RE.search(head)
    return m.group(1) if m else None


def summarize_checkpoint(checkpoint_dir: str, *, stats_dump: str | None = None) -> CheckpointSummary:
    """Summarize the CRIU images in `checkpoint_dir` (a ``criu dump -D`` dir or an archive's checkpoint/).

    `stats_dump` defaults to ``stats-dump`` in the dir or, for an archive's ``checkpoint/`` dir, at the
    archive root. Raises FailedPrecondition when pycriu is missing or an image is missing or corrupt.
    """
    images = _pycriu_images()
    page_size = resource.getpagesize()
    warnings: list[str] = []
    tree = _process_tree(images, checkpoint_dir)
    pages_file_bytes = _pages_file_bytes(checkpoint_dir, tree)
    memory_bytes = tree.present_pages * page_size
    if memory_bytes != pages_file_bytes:
        warnings.append(
            f"pagemaps list {memory_bytes} bytes of pages but pages-*.img hold {pages_file_bytes} bytes "
            "(lazy/incremental dump, or a truncated checkpoint)"
        )
    stats = _dump_stats(images, checkpoint_dir, stats_dump, warnings)

    def stat_us(key: str) -> int | None:
        v = stats.get(key)
        return v if isinstance(v, int) else None

    pages_written = stat_us("pages_written")
    if pages_written is None:
        pages_written = tree.present_pages
    elif pages_written != tree.present_pages:
        warnings.append(f"stats-dump says {pages_written} pages written, the pagemaps list {tree.present_pages}")

    return CheckpointSummary(
        processes=tree.processes,
        process_count=len(tree.processes),
        pages_written=pages_written,
        page_size=page_size,
        memory_bytes=memory_bytes,
        pages_file_bytes=pages_file_bytes,
        vma_bytes=tree.vma_bytes,
        freezing_time_us=stat_us("freezing_time"),
        frozen_time_us=stat_us("frozen_time"),
        memdump_time_us=stat_us("memdump_time"),
        memwrite_time_us=stat_us("memwrite_time"),
        criu_version=_criu_version(_sibling(checkpoint_dir, DUMP_LOG_FILE)),
        img_version=_img_version(images, checkpoint_dir),
        warnings=warnings,
    )


@dataclass
class _Tree:
    processes: list[ProcessInfo]
    present_pages: int  # pages the pagemaps say are in this dump's pages-*.img (not in a parent's)
    vma_bytes: int
    pages_ids: set[int]


def _process_tree(images: Any, checkpoint_dir: str) -> _Tree:
    """The processes of pstree.img with their memory: VMAs and present pages of each (zombies have none)."""
    pstree_path = os.path.join(checkpoint_dir, "pstree.img")
    pstree = _load(images, pstree_path)
    if not pstree:
        raise FailedPrecondition(f"{pstree_path} lists no processes", hint=_HINT_CORRUPT)
    tree = _Tree(processes=[], present_pages=0, vma_bytes=0, pages_ids=set())
    for entry in pstree:
        pid = _int(entry, "pid", pstree_path)
        core_path = os.path.join(checkpoint_dir, f"core-{pid}.img")
        core = _load(images, core_path)
        tc = core[0].get("tc") if core else None
        comm = tc.get("comm") if isinstance(tc, dict) else None
        if not isinstance(comm, str):  # pycriu parses a truncated image into a partial or empty entry
            raise FailedPrecondition(f"CRIU image {core_path} is incomplete (no task comm)", hint=_HINT_CORRUPT)
        threads = entry.get("threads") or [pid]
        tree.processes.append(
            ProcessInfo(
                pid=pid,
                ppid=_int(entry, "ppid", pstree_path),
                pgid=_int(entry, "pgid", pstree_path),
                sid=_int(entry, "sid", pstree_path),
                comm=comm,
                threads=len(threads),
            )
        )
        mm_path = os.path.join(checkpoint_dir, f"mm-{pid}.img")
        if not os.path.lexists(mm_path):
            continue  # a zombie has no memory images
        for mm in _load(images, mm_path):
            for vma in mm.get("vmas", []):
                tree.vma_bytes += _int(vma, "end", mm_path) - _int(vma, "start", mm_path)
        pm_path = os.path.join(checkpoint_dir, f"pagemap-{pid}.img")
        pagemap = _load(images, pm_path)
        if pagemap and "pages_id" in pagemap[0]:
            tree.pages_ids.add(_int(pagemap[0], "pages_id", pm_path))
        for pm in pagemap[1:]:
            flags = pm.get("flags", PE_PRESENT)
            if isinstance(flags, int) and flags & PE_PRESENT and not flags & PE_PARENT:
                tree.present_pages += _int(pm, "nr_pages", pm_path)
    return tree


def _pages_file_bytes(checkpoint_dir: str, tree: _Tree) -> int:
    """The size of the dump's pages-*.img; every pages file a pagemap names must be there."""
    for pages_id in sorted(tree.pages_ids):
        if tree.present_pages and not os.path.lexists(os.path.join(checkpoint_dir, f"pages-{pages_id}.img")):
            raise FailedPrecondition(f"checkpoint is missing pages-{pages_id}.img", hint=_HINT_CORRUPT)
    total = 0
    for name in os.listdir(checkpoint_dir):
        if re.fullmatch(r"pages-\d+\.img", name):
            total += os.stat(os.path.join(checkpoint_dir, name), follow_symlinks=False).st_size
    return total


def _dump_stats(images: Any, checkpoint_dir: str, stats_dump: str | None, warnings: list[str]) -> dict[str, Any]:
    """CRIU's own dump statistics (stats-dump), {} when absent."""
    stats_path = stats_dump if stats_dump is not None else _sibling(checkpoint_dir, STATS_DUMP_FILE)
    if stats_path is None:
        return {}
    entries = _load(images, stats_path)
    dump = entries[0].get("dump") if entries else None
    if isinstance(dump, dict):
        return dump
    warnings.append(f"{stats_path} holds no dump statistics")
    return {}


def _img_version(images: Any, checkpoint_dir: str) -> int | None:
    inventory_path = os.path.join(checkpoint_dir, "inventory.img")
    if not os.path.lexists(inventory_path):
        return None
    inv = _load(images, inventory_path)
    v = inv[0].get("img_version") if inv else None
    return v if isinstance(v, int) else None


def files_without_root_mode(checkpoint_dir: str) -> bytes | None:
    """files.img with no recorded mode for the root directory ("/"): the bytes to export in its
    place, or None where it records none. CRIU refuses a restore whose root has another mode than at
    dump, and an image layer without an entry for its root gets 0755 from containerd but 0555 from
    containers/storage (podman): the mode of the root is the runtime's, not the process's state, so
    an export for podman leaves it unchecked. Every other file keeps its check."""
    import io
    import stat

    images = _pycriu_images()
    path = os.path.join(checkpoint_dir, "files.img")
    fd = _open_nofollow(path)
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > MAX_IMAGE_BYTES:
            raise FailedPrecondition(f"CRIU image {path} is too large to be metadata")
        try:
            img = images.load(f)
        except Exception as e:  # pycriu raises many kinds on bad input
            raise FailedPrecondition(f"cannot decode CRIU image {path}: {type(e).__name__}: {e}") from e
    changed = False
    for entry in img.get("entries") or []:
        reg = entry.get("reg") if isinstance(entry, dict) else None
        if isinstance(reg, dict) and reg.get("name") == "/" and stat.S_ISDIR(int(reg.get("mode") or 0)):
            del reg["mode"]
            changed = True
    if not changed:
        return None
    out = io.BytesIO()
    images.dump(img, out)
    return out.getvalue()
