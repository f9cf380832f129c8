"""CRIU's kernel-feature cache (kdat) on nodes whose /run is not a tmpfs; set up by install-node.

Every CRIU run (each dump and restore, and runc's ``criu swrk``) starts by probing the kernel: about
thirty probes (namespaces, sockets, netfilter via ``iptables -L``, mount API, pagemap, ...), 25-35 ms
on the project's 2-vCPU VMs. CRIU keeps their result in ``KDAT_RUNDIR/criu.kdat`` (``/run/criu.kdat``
in Debian's and upstream's builds: criu/kerndat.c, ``KERNDAT_CACHE_FILE``) and loads it on the next run,
but it *writes* the file only when ``criu.kdat.tmp`` beside it is on a tmpfs (``fstatfs`` ==
TMPFS_MAGIC, else "Can't keep kdat cache on non-tempfs"): the cache must be gone after a reboot, which
is CRIU's whole staleness rule (it checks only a magic, its own build's time stamp and the struct size,
never the kernel's version or boot id). Loading does not check the file system.

Where systemd is init, /run is a tmpfs (one of systemd's API file systems) and CRIU caches by itself:
state "native", nothing is done. Where /run is a plain directory (the project's VMs, containers'
nodes without systemd), install-node makes the same arrangement CRIU would have, in memory:

1. a small tmpfs at ``/run/kubectl-snapshot-kdat`` (host's mount namespace; gone at reboot, like
   /run's);
2. the installed CRIU's ``criu check`` writes ``criu.kdat`` there, run in a private mount namespace in
   which that tmpfs stands at /run (the probes look at /proc, /dev, /tmp and the kernel, never /run);
3. that file is bind-mounted (read-only) onto ``/run/criu.kdat`` (an empty placeholder file is created
   to mount on). Every CRIU of the same build then loads it; another build finds it "stale", cannot
   unlink it (a mount point) and probes as before: never worse than without the cache.

After a reboot the tmpfs and the bind mount are gone; the placeholder left is empty, which CRIU treats
as stale and removes, and the agent's init container (install-node) arranges it again. install-node
regenerates the file each time (a new CRIU build gets its own). uninstall-node undoes all of it
(several nodes of one host share /run: the first uninstall takes the cache from the others, which only
makes their CRIU probe again). Such nodes' install-node runs take turns: each holds an exclusive flock
on the cache file's directory (/run itself, so nothing is left behind) while it changes the mounts; two
at once (every agent restarted together) would unmount each other's bind, and the one that failed would
remove the cache for both.

The work runs in a child process (``python -m shim.criu.kdat``) that joins the host's mount namespace
(setns) when the agent runs in a container: mounts must be made there, and no host tool is used.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shim.host.facts import find_host_pid
from shim.host.mounts import (
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    Mount,
    current,
    join_host,
    mount,
    mount_at,
    mount_of,
    parse_mountinfo,
    run_child,
    umount,
    unshare_mounts,
)

__all__ = ["KDAT_FILE", "KdatResult", "Mount", "ensure", "mount_at", "mount_of", "parse_mountinfo", "remove"]

KDAT_FILE = "/run/criu.kdat"  # upstream's and Debian's RUNDIR; kdat_path() reads it off a binary
CACHE_NAME = "kubectl-snapshot-kdat"  # the small tmpfs holding the cache file, beside it
SOURCE = "kubectl-snapshot-kdat"  # the tmpfs's source name: how our mounts are recognised
TMPFS_OPTIONS = "size=256k,nr_inodes=16,mode=0700"

LOCK_WAIT_S = 150.0  # another node's ensure (a `criu check`) takes about a second; the caller waits 180 s


@dataclass(frozen=True)
class KdatResult:
    path: str
    state: str  # "native" (tmpfs /run), "mounted", "removed", "absent", "foreign", "failed"
    detail: str = ""


def kdat_path(binary: bytes) -> str:
    """Where this CRIU build keeps its cache: the ``<RUNDIR>/criu.kdat`` string compiled into it."""
    m = re.search(rb"\x00(/[\x21-\x7e]*)/criu\.kdat\x00", binary)
    return m.group(1).decode() + "/criu.kdat" if m else KDAT_FILE


def cache_dir(kdat: str) -> str:
    return os.path.join(os.path.dirname(kdat), CACHE_NAME)


def decide(kdat: str, mounts: list[Mount]) -> str:
    """What ensure() does on a host with these mounts: "native" (CRIU caches itself: its directory is a
    tmpfs), "foreign" (something else is mounted on the cache file), or "mount"."""
    holder = mount_of(os.path.dirname(kdat), mounts)
    if holder is not None and holder.fstype == "tmpfs":
        return "native"
    top = mount_at(kdat, mounts)
    if top is not None and top.source != SOURCE:
        return "foreign"
    return "mount"


# --- the child process: runs in the host's mount namespace ------------------------------------------


def _private_run(directory: str, run_dir: str) -> None:
    """In the `criu check` child: a private mount namespace in which the cache's tmpfs is `run_dir` (/run)."""
    unshare_mounts()
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount(directory, run_dir, None, MS_BIND)


def _unmount_ours(path: str) -> bool:
    """Unmount every mount of ours stacked at `path`; False when something else is (still) mounted there."""
    for _ in range(8):
        top = mount_at(path, current())
        if top is None:
            return True
        if top.source != SOURCE:
            return False
        umount(path)
    return mount_at(path, current()) is None


def _remove_placeholder(kdat: str) -> None:
    with contextlib.suppress(OSError):
        if mount_at(kdat, current()) is None and os.path.isfile(kdat) and os.path.getsize(kdat) == 0:
            os.unlink(kdat)


@contextlib.contextmanager
def _host_lock(kdat: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Exclusive flock on the directory of the cache file (in the host's mount namespace): one ensure or
    remove at a time among the nodes that share it. Raises TimeoutError when another holds it too long."""
    fd = os.open(os.path.dirname(kdat) or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    held = os.path.dirname(kdat)
                    raise TimeoutError(f"another install-node held {held} for {wait_s:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def do_ensure(criu: str, kdat: str) -> KdatResult:
    mounts, where = current(), cache_dir(kdat)
    what = decide(kdat, mounts)
    if what == "native":
        holder = mount_of(os.path.dirname(kdat), mounts)
        return KdatResult(
            kdat, "native", f"{holder.mount_point if holder else '/'} is a tmpfs: CRIU keeps its cache there itself"
        )
    if what == "foreign":
        return KdatResult(kdat, "foreign", f"{kdat} has a mount not made by kubectl-snapshot: left alone")
    os.makedirs(where, mode=0o700, exist_ok=True)
    top = mount_at(where, mounts)
    if top is None or top.source != SOURCE:
        mount(SOURCE, where, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, TMPFS_OPTIONS)
    name = os.path.basename(kdat)
    cached = os.path.join(where, name)
    for stale in (cached, cached + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    proc = subprocess.run(
        [criu, "check"],
        preexec_fn=lambda: _private_run(where, os.path.dirname(kdat)),  # this child process is single-threaded
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if not os.path.isfile(cached) or os.path.getsize(cached) == 0:
        out = (proc.stdout + proc.stderr).strip()[-300:]
        _unmount_ours(where)
        return KdatResult(kdat, "failed", f"`criu check` wrote no {name} (exit {proc.returncode}): {out}")
    if not _unmount_ours(kdat):
        _unmount_ours(where)
        return KdatResult(kdat, "foreign", f"{kdat} has a mount not made by kubectl-snapshot: left alone")
    for _ in range(3):  # a CRIU that finds the empty placeholder "stale" unlinks it: make it again
        fd = os.open(kdat, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(fd)
        try:
            mount(cached, kdat, None, MS_BIND)
            break
        except FileNotFoundError:
            continue
    mount(None, kdat, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
    size = os.path.getsize(kdat)
    return KdatResult(kdat, "mounted", f"{size}-byte cache from a tmpfs at {where}, bound read-only on {kdat}")


def do_remove(kdat: str) -> KdatResult:
    mounts, where = current(), cache_dir(kdat)
    had = mount_at(kdat, mounts) is not None or mount_at(where, mounts) is not None
    left = not _unmount_ours(kdat)
    _remove_placeholder(kdat)
    _unmount_ours(where)
    with contextlib.suppress(OSError):
        os.rmdir(where)
    if left:
        return KdatResult(kdat, "foreign", f"{kdat} has a mount not made by kubectl-snapshot: left alone")
    return KdatResult(kdat, "removed" if had else "absent")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shim.criu.kdat", description="CRIU's kdat cache on a tmpfs")
    ap.add_argument("action", choices=("ensure", "remove"))
    ap.add_argument("--criu", default="criu")
    ap.add_argument("--kdat", default=KDAT_FILE)
    ap.add_argument("--host-pid", type=int, default=0, help="join this process's mount namespace first")
    a = ap.parse_args(argv)
    if a.host_pid:
        join_host(a.host_pid)
    try:
        with _host_lock(a.kdat):
            try:
                res = do_ensure(a.criu, a.kdat) if a.action == "ensure" else do_remove(a.kdat)
            except OSError as e:
                res = KdatResult(a.kdat, "failed", str(e))
                if a.action == "ensure":  # nothing half made is left: CRIU then probes as before
                    with contextlib.suppress(OSError):
                        do_remove(a.kdat)
    except OSError as e:  # the lock (TimeoutError is one): nothing was changed
        res = KdatResult(a.kdat, "failed", str(e))
    print(json.dumps(res.__dict__))
    return 0


# --- the agent's side ---------------------------------------------------------------------------------


def _run(args: list[str], host_pid: int | None) -> KdatResult:
    got = run_child("shim.criu.kdat", args, host_pid, timeout=180, rescan=find_host_pid)
    try:
        return KdatResult(**got) if isinstance(got, dict) else KdatResult(KDAT_FILE, "failed", got)
    except TypeError:
        return KdatResult(KDAT_FILE, "failed", f"unexpected answer: {got}"[:300])


def ensure(criu: str, *, kdat: str = KDAT_FILE, host_pid: int | None = None) -> KdatResult:
    """Arrange the cache for `criu` (a host path; the installed CRIU) if /run is not a tmpfs; never raises:
    without the cache CRIU only probes as before."""
    return _run(["ensure", "--criu", criu, "--kdat", kdat], host_pid)


def remove(*, kdat: str = KDAT_FILE, host_pid: int | None = None) -> KdatResult:
    return _run(["remove", "--kdat", kdat], host_pid)


if __name__ == "__main__":
    sys.exit(main())
