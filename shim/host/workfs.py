"""The memory work area on a tmpfs of its own, with large folios; set up by install-node.

Dumps that clearly fit go to the node's memory work area (shim/host/memwork.py), by default a directory in
the host's /dev/shm. That tmpfs keeps its files in 4 KiB pages (``huge=never``, the kernel's default for
tmpfs mounts), so CRIU writing a dump there pays a page allocation and its bookkeeping per 4 KiB, and
freeing the dump as much again: on the project's VMs (kernel 6.18) a raw ``criu dump`` of a 64 MiB object
heap took 108 ms into /dev/shm, 89 ms into the ext4 state dir (whose page cache uses large folios) and 76
ms into a tmpfs mounted with ``huge=within_size``; 465, 339 and 257 ms at 512 MiB; removing the 64 MiB
dump 13.6, 6.6 and 1.4 ms (bench/dump_targets.py; docs/performance.md, "The memory work area with large
folios"). The dump is written while the pod is frozen, so that difference is frozen time.

So install-node mounts a tmpfs of its own at this agent's area directory (``memwork.area_dir``: one per
agent state dir below the base, so agents sharing a host never mount over each other), in the host's
mount namespace, before the agent's container starts (its host path mount is recursive, and includes
it): ``huge=within_size`` (a file's pages come in large folios, 8 KiB up to 2 MiB, as far as its size
reaches: on this kernel the writes of a dump are mostly 8 KiB-1 MiB folios), ``size`` = the area's
limit, mode 0700, nosuid, nodev, noexec. memwork's checks are the
same for it (a tmpfs, root's alone, the host's own directory).

Left alone: a kernel that refuses ``huge=`` for tmpfs (no transparent huge pages; the dumps go to
/dev/shm's directory as before), an area that is not empty (a killed agent's dump is recover's to read
first: the next start mounts), something else mounted there, dumps in memory turned off (then a mount
of ours is removed). uninstall-node unmounts it. Large folios are taken without waiting for the kernel to
make them (with ``defrag`` at madvise, the default, a file's write does not compact or reclaim memory
for one: where none is free, the file gets smaller folios; /sys/kernel/mm/transparent_hugepage/
hugepages-*/stats/shmem_alloc and shmem_fallback count them).

The work runs in a child process (``python -m shim.host.workfs``) that joins the host's mount namespace
when the agent runs in a container, as shim/criu/kdat.py's does.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
from dataclasses import asdict, dataclass

from shim.host.facts import find_host_pid
from shim.host.mounts import (
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_REMOUNT,
    current,
    join_host,
    mount,
    mount_at,
    run_child,
    umount,
)

SOURCE = "kubectl-snapshot-work"  # the tmpfs's source name: how our mounts are recognised
HUGE = "within_size"


@dataclass(frozen=True)
class WorkFsResult:
    path: str
    # "mounted", "kept" (ours already), "resized" (ours, to a changed limit), "busy", "foreign",
    # "no large folios", "removed", "absent", "failed"
    state: str
    detail: str = ""


def _mib(size_bytes: int) -> int:
    return max(1, -(-size_bytes // (1 << 20)))


def options(size_bytes: int) -> str:
    """The tmpfs's options: large folios, the area's size (whole MiB, at least 1), root's alone."""
    return f"huge={HUGE},size={_mib(size_bytes)}m,mode=0700"


def _size_kib(mount_options: str) -> int | None:
    """A tmpfs's size= as mountinfo shows it (KiB), or None."""
    for opt in mount_options.split(","):
        if opt.startswith("size=") and opt.endswith("k") and opt[5:-1].isdigit():
            return int(opt[5:-1])
    return None


def do_ensure(path: str, size_bytes: int) -> WorkFsResult:
    top = mount_at(path, current())
    if top is not None:
        if top.source != SOURCE:
            return WorkFsResult(path, "foreign", f"{path} has a mount not made by kubectl-snapshot: left alone")
        want = options(size_bytes)
        if _size_kib(top.options) == _mib(size_bytes) * 1024:
            return WorkFsResult(path, "kept", top.options)
        # the area's limit changed since it was mounted: resized in place (a tmpfs refuses a size below
        # what it holds; then it stays as it was)
        try:
            mount(SOURCE, path, "tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC, want)
        except OSError as e:
            return WorkFsResult(path, "kept", f"{top.options}; not resized to {want}: {e}")
        top = mount_at(path, current())
        return WorkFsResult(path, "resized", top.options if top is not None else want)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if os.listdir(path):
        return WorkFsResult(path, "busy", "a dump is there (a killed agent's): mounted at a later start")
    try:
        mount(SOURCE, path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options(size_bytes))
    except OSError as e:
        if e.errno == errno.EINVAL:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return WorkFsResult(path, "no large folios", "this kernel refuses huge= for tmpfs: /dev/shm as before")
        raise
    top = mount_at(path, current())
    return WorkFsResult(path, "mounted", top.options if top is not None else "")


def do_remove(path: str) -> WorkFsResult:
    had = False
    for _ in range(8):
        top = mount_at(path, current())
        if top is None:
            break
        if top.source != SOURCE:
            return WorkFsResult(path, "foreign", f"{path} has a mount not made by kubectl-snapshot: left alone")
        umount(path)
        had = True
    return WorkFsResult(path, "removed" if had else "absent")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shim.host.workfs", description="the memory work area's tmpfs")
    ap.add_argument("action", choices=("ensure", "remove"))
    ap.add_argument("--path", required=True)
    ap.add_argument("--size", type=int, default=0, help="bytes")
    ap.add_argument("--host-pid", type=int, default=0, help="join this process's mount namespace first")
    a = ap.parse_args(argv)
    try:
        if a.host_pid:
            join_host(a.host_pid)
        res = do_ensure(a.path, a.size) if a.action == "ensure" else do_remove(a.path)
    except OSError as e:
        res = WorkFsResult(a.path, "failed", str(e))
    print(json.dumps(asdict(res)))
    return 0


# --- the agent's side ---------------------------------------------------------------------------------


def _run(args: list[str], path: str, host_pid: int | None) -> WorkFsResult:
    got = run_child("shim.host.workfs", [*args, "--path", path], host_pid, timeout=60, rescan=find_host_pid)
    try:
        return WorkFsResult(**got) if isinstance(got, dict) else WorkFsResult(path, "failed", got)
    except TypeError:
        return WorkFsResult(path, "failed", f"unexpected answer: {got}"[:300])


def ensure(path: str, size_bytes: int, *, host_pid: int | None = None) -> WorkFsResult:
    """Mount the area's tmpfs at `path` (a host path) unless one is there; with `size_bytes` 0 (dumps in
    memory off) remove ours instead. Never raises: without it dumps go where they went before."""
    if size_bytes <= 0:
        return remove(path, host_pid=host_pid)
    return _run(["ensure", "--size", str(size_bytes)], path, host_pid)


def remove(path: str, *, host_pid: int | None = None) -> WorkFsResult:
    return _run(["remove"], path, host_pid)


if __name__ == "__main__":
    sys.exit(main())
