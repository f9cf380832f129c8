"""Mounts in the host's mount namespace, made without any host tool (install-node's child processes).

The mount table read from /proc/PID/mountinfo, and mount(2), umount2(2) and setns(2) through libc: what
shim/criu/kdat.py (CRIU's kernel-feature cache) and shim/host/workfs.py (the memory work area's tmpfs) do
from a child process that joins the host's mount namespace when the agent runs in a container.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000


@dataclass(frozen=True)
class Mount:
    mount_point: str
    root: str  # the mounted file system's path that appears there ("/" or, for a bind, the file)
    fstype: str
    source: str
    # the file system's own options (mountinfo's super options: size=, huge=, ...); not compared
    options: str = field(default="", compare=False)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """/proc/PID/mountinfo lines, in order (a later line is mounted over an earlier one)."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 2:
            continue
        out.append(Mount(_unescape(fields[4]), _unescape(fields[3]), tail[0], _unescape(tail[1]),
                         tail[2] if len(tail) > 2 else ""))  # fmt: skip
    return out


def mount_at(path: str, mounts: list[Mount]) -> Mount | None:
    """The topmost mount whose mount point is exactly `path`."""
    hits = [m for m in mounts if m.mount_point == path]
    return hits[-1] if hits else None


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount that holds `path`: the topmost one with the longest mount point above (or at) it."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        if (path == mp or path.startswith(mp.rstrip("/") + "/")) and (
            best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")
        ):
            best = m
    return best


def current() -> list[Mount]:
    """This process's mount table."""
    with open("/proc/self/mountinfo") as f:
        return parse_mountinfo(f.read())


_libc = ctypes.CDLL(None, use_errno=True)


def check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [s.encode() if s is not None else None for s in (source, target, fstype, data)]
    check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def umount(target: str) -> None:
    check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def unshare_mounts() -> None:
    check(_libc.unshare(CLONE_NEWNS), "unshare the mount namespace")


def join_host(host_pid: int) -> None:
    """Enter the mount namespace of `host_pid` (the host's init, seen with hostPID) and its root's cwd."""
    fd = os.open(f"/proc/{host_pid}/ns/mnt", os.O_RDONLY)
    try:
        check(_libc.setns(fd, CLONE_NEWNS), "setns to the host's mount namespace")
    finally:
        os.close(fd)
    os.chdir("/")


def run_child(
    module: str,
    args: list[str],
    host_pid: int | None,
    timeout: float,
    *,
    rescan: Callable[[], int | None] | None = None,
) -> dict[str, Any] | str:
    """``python -m module args`` (joining `host_pid`'s mount namespace first, where given): the JSON
    object on its last line of output, or, when there is none, the tail of what it printed.

    Where the child could not join because `host_pid` ended meanwhile (the node's containerd, which
    stands in for the host's init where that is out of reach, restarted by the install a moment before),
    `rescan` (facts.find_host_pid) looks up a live host process and the child runs again (twice at most)."""
    got = _run_child(module, args, host_pid, timeout)
    for _ in range(2 if rescan is not None else 0):
        ns = f"/proc/{host_pid}/ns/mnt"
        if not host_pid or ns not in str(got) or os.path.exists(ns):
            break
        host_pid = rescan() if rescan is not None else None
        got = _run_child(module, args, host_pid, timeout)
    return got


def _run_child(module: str, args: list[str], host_pid: int | None, timeout: float) -> dict[str, Any] | str:
    cmd = [sys.executable, "-m", module, *args] + (["--host-pid", str(host_pid)] if host_pid else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    try:
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        got = None
    return got if isinstance(got, dict) else (proc.stdout + proc.stderr).strip()[-300:]
