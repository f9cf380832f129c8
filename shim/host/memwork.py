"""Dumps in memory: the node's tmpfs work area for snapshots that clearly fit (core/dumpspace.py).

Where: ``KUBECTL_SNAPSHOT_MEMORY_WORK_DIR`` (default ``/dev/shm/kubectl-snapshot``, the host's tmpfs;
the DaemonSet mounts that host directory at the same path), one directory per agent state dir inside
it (several nodes on one machine, tests), one per snapshot inside that. How much:
``KUBECTL_SNAPSHOT_MEMORY_WORK_MIB`` (default 1024; 0 turns dumps in memory off), all dumps in memory
at once; the node keeps a tenth of its memory (at least 512 MiB) available besides.

It is used only where every path the dump crosses agrees on it:

- it is a tmpfs (/proc/self/mountinfo) and a directory of root's that no one else may write, at every
  level this module creates or finds (the host's /dev/shm is world-writable: a directory planted there
  by someone else is never used);
- in a container, it is the same directory as the host's at that path (containerd's runtime writes a
  dump there from the host's mount namespace): a container's own /dev/shm is not.

Anything else, or any error, means the state dir on disk, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import threading
from collections.abc import Iterator, Mapping

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.dumpspace import MIB, MemorySpace, dump_bytes, fits_in_memory
from shim.host import reaper, workfs
from shim.host.facts import host_pid
from shim.host.mounts import mount_of, parse_mountinfo

log = logging.getLogger(__name__)

ENV_DIR = "KUBECTL_SNAPSHOT_MEMORY_WORK_DIR"
ENV_MIB = "KUBECTL_SNAPSHOT_MEMORY_WORK_MIB"
DEFAULT_DIR = C.DEFAULT_MEMORY_WORK_DIR
DEFAULT_MIB = 1024
MIN_HEADROOM = 512 * MIB
INLINE_BYTES = 4096  # at most what a file may hold without blocks of its own (inline data)
MAX_TREE_ENTRIES = 20_000  # a writable layer with more entries than this is not sized: the disk

_lock = threading.Lock()
_reserved: dict[str, int] = {}  # area directory -> bytes promised to dumps in flight (this process)
_warned: set[str] = set()
_announced: set[str] = set()


def limit_bytes(environ: Mapping[str, str] = os.environ) -> int:
    raw = environ.get(ENV_MIB, "").strip()
    mib = int(raw) if raw.isdigit() and int(raw) <= 1 << 30 else DEFAULT_MIB
    return mib * MIB


def area_dir(state_root: str, environ: Mapping[str, str] = os.environ) -> str:
    """This agent's directory in the memory work area (keyed by its state dir)."""
    base = environ.get(ENV_DIR, "").strip() or DEFAULT_DIR
    key = hashlib.sha256(os.path.abspath(state_root).encode()).hexdigest()[:16]
    return os.path.join(base, key)


def tree_size(path: str, max_entries: int = MAX_TREE_ENTRIES) -> int | None:
    """Bytes of the regular files under `path` (what they hold, holes left out), a tree the workload
    writes: walked through directory fds opened with O_NOFOLLOW, so a directory swapped for a link
    meanwhile is never followed. None past max_entries entries, or when the tree changed under the walk."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fds = [os.open(path, flags)]
    except FileNotFoundError:
        return 0
    except OSError:
        return None
    total, seen = 0, 0
    try:
        while fds:
            fd = fds.pop()
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        seen += 1
                        if seen > max_entries:
                            return None
                        st = os.stat(e.name, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            fds.append(os.open(e.name, flags, dir_fd=fd))
                        elif stat.S_ISREG(st.st_mode):
                            # a sparse file's holes are not captured (shim/files/archive.py); a file with no
                            # blocks may hold its few bytes in its inode
                            total += min(st.st_size, max(st.st_blocks * 512, INLINE_BYTES))
            finally:
                os.close(fd)
    except OSError:  # changed under the walk (the workload runs): not sized, the disk
        return None
    finally:
        for fd in fds:
            os.close(fd)
    return total


def _owned(st: os.stat_result) -> bool:
    """A real directory (not a link) of this user's that no one else may write."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _private_dir(path: str) -> bool:
    """`path` is (made) a real directory of this user's that no one else may write."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    return _owned(os.lstat(path))


def _mem_available() -> tuple[int, int]:
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable") and rest.split():
                fields[key] = int(rest.split()[0]) * 1024
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


def _usable(area: str) -> bool:
    base = os.path.dirname(area)
    if not (_private_dir(base) and _private_dir(area)):
        raise OSError(f"{base} or {area} is not a directory of root's that no one else may write")
    with open("/proc/self/mountinfo") as f:
        holder = mount_of(os.path.realpath(area), parse_mountinfo(f.read()))
    if holder is None or holder.fstype != "tmpfs":
        raise OSError(f"{area} is not on a tmpfs")
    hp = host_pid()
    if hp is not None:  # in a container: the host must see the same directory at the same path
        mine, hosts = os.stat(area), os.stat(f"/proc/{hp}/root{area}")
        if (mine.st_dev, mine.st_ino) != (hosts.st_dev, hosts.st_ino):
            raise OSError(f"{area} is not the host's {area} (mount the host directory at the same path)")
    if area not in _announced:  # once: where this agent's dumps in memory go
        _announced.add(area)
        ours = holder.source == workfs.SOURCE and holder.mount_point == os.path.realpath(area)
        what = "install-node's tmpfs with large folios" if ours else f"the tmpfs at {holder.mount_point}"
        log.info("dumps that clearly fit go to %s: %s (%s)", area, what, holder.options)
    return True


@contextlib.contextmanager
def reserve(state_root: str, snapshot_id: str, expected: int | None) -> Iterator[str | None]:
    """A fresh work directory in memory for a dump of `expected` bytes, or None (use the disk). The
    directory goes when the block ends, removed on a thread (shim/host/reaper.py), and its reservation once
    that is done."""
    limit = limit_bytes()
    if expected is None or limit <= 0 or dump_bytes(expected) > limit:  # the disk, without touching the area
        yield None
        return
    area = area_dir(state_root)
    need = dump_bytes(expected)
    chosen: str | None = None
    try:
        with _lock:
            if _usable(area):
                vfs = os.statvfs(area)
                available, total = _mem_available()
                space = MemorySpace(
                    limit=limit,
                    reserved=_reserved.get(area, 0),
                    fs_free=vfs.f_bavail * vfs.f_frsize,
                    mem_available=available,
                    headroom=max(MIN_HEADROOM, total // 10),
                )
                if fits_in_memory(expected, space):
                    chosen = os.path.join(area, snapshot_id)
                    os.mkdir(chosen, 0o700)
                    _reserved[area] = space.reserved + need
                elif area not in _reserved:
                    _remove_empty(area)
    except OSError as e:
        chosen = None
        with _lock:
            if area not in _reserved:
                _remove_empty(area)  # what this call made (a directory planted by someone else stays)
        if area not in _warned:
            _warned.add(area)
            log.warning("dumps go to disk, not memory: %s", e)
    try:
        yield chosen
    finally:
        if chosen is not None:

            def release() -> None:
                with _lock:
                    left = _reserved.get(area, 0) - need
                    if left > 0:
                        _reserved[area] = left
                    else:
                        _reserved.pop(area, None)
                        _remove_empty(area)

            # after the answer: its space is promised to this dump until it is free again (shim/host/reaper.py)
            reaper.remove_later(chosen, then=release)


def _remove_empty(area: str) -> None:
    """The area's directories once nothing is in them (the base stays where it is a mount point)."""
    for d in (area, os.path.dirname(area)):
        try:
            os.rmdir(d)
        except OSError:
            return


def remove_area(area: str) -> None:
    """What an agent's area holds, and the base if that leaves it empty (uninstall-node)."""
    shutil.rmtree(area, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(area))


def tidy(state_root: str) -> None:
    """The agent's area and the base, if nothing is in them (after recover_interrupted's removals)."""
    with _lock:
        if not _reserved:
            _remove_empty(area_dir(state_root))


def leftovers(state_root: str) -> list[str]:
    """Work directories a killed agent left in its memory area (recover_interrupted reads and removes
    them); none where the area is not there or not ours."""
    area = area_dir(state_root)
    try:
        st = os.lstat(area)
    except OSError:
        return []
    if not _owned(st):
        return []
    return [os.path.join(area, e) for e in sorted(os.listdir(area))]
