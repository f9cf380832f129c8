"""Freeze and thaw a container's cgroup by writing the kernel's freezer files directly.

containerd's Pause/Resume end in exactly this write (runc pause/resume), after a gRPC call, the
shim's ttrpc call and a runc process each way: ~11 ms per direction on the project's VMs against
~0.4 ms for the write (bench/freeze_breakdown.py). The freeze is the one span the workload feels, so
the agent writes the files itself where it can find them, and falls back to containerd otherwise.

runc derives a container's "paused" status from the same freezer state, so runc and CRIU see a
directly frozen container as paused (CRIU leaves a cgroup it found frozen frozen). containerd's shim
keeps its own state and still says "running": recovery after a crash therefore checks the freezer
itself (checkpoint.recover_interrupted).

Found from the task's ``/proc/PID/cgroup`` (cgroup v1 ``N:freezer:/path``, v2 ``0::/path``) under the
host's cgroupfs. Paths relative to a private cgroup namespace (``/..``) cannot be placed and fall
back, as does a directory whose ``cgroup.procs`` does not list the task.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

FREEZE_TIMEOUT = 10.0


@dataclass(frozen=True)
class CgroupFreezer:
    directory: str
    v2: bool

    @property
    def _control(self) -> str:
        return os.path.join(self.directory, "cgroup.freeze" if self.v2 else "freezer.state")

    def _write(self, value: str) -> None:
        with open(self._control, "w") as f:
            f.write(value)

    def frozen(self) -> bool:
        if self.v2:
            with open(os.path.join(self.directory, "cgroup.events")) as f:
                return "frozen 1" in f.read().splitlines()
        with open(self._control) as f:
            return f.read().strip() == "FROZEN"

    def ready(self) -> None:
        """Always ready: the cgroup is written directly."""

    def freeze(self, timeout: float = FREEZE_TIMEOUT, *, deadline_s: float | None = None) -> None:
        """Freeze and wait until every task of the cgroup is frozen; on timeout thaw and raise.

        `deadline_s` is not enforced here (nothing outlives this process): shim.freeze_guard does that."""
        self._write("1" if self.v2 else "FROZEN")
        deadline = time.monotonic() + timeout
        delay = 0.0002
        while not self.frozen():
            if time.monotonic() > deadline:
                self.thaw()
                raise TimeoutError(f"the cgroup {self.directory} did not freeze within {timeout:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
            if not self.v2:
                self._write("FROZEN")  # v1 may stay FREEZING until asked again

    def thaw(self) -> None:
        self._write("0" if self.v2 else "THAWED")


def parse_proc_cgroup(text: str) -> tuple[str, bool] | None:
    """(cgroup path, is v2) of the freezer in a /proc/PID/cgroup text; None when there is none."""
    unified = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "freezer" in controllers.split(","):
            return path, False
        if controllers == "":
            unified = path
    return (unified, True) if unified is not None else None


def cgroupfs_root(host_pid: int | None) -> str:
    """The host's cgroupfs as this process reaches it (through the host's mount namespace in a container)."""
    return f"/proc/{host_pid}/root/sys/fs/cgroup" if host_pid else "/sys/fs/cgroup"


def lookup(pid: int) -> CgroupFreezer | None:
    """`for_task` with this machine's host root (the agent and its CLI pass this as `freezer_for`)."""
    from shim.host.facts import host_pid

    return for_task(pid, host_pid())


def for_task(pid: int, host_pid: int | None) -> CgroupFreezer | None:
    """The freezer of task `pid`'s cgroup, or None when it cannot be placed safely (then: containerd)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            found = parse_proc_cgroup(f.read())
    except OSError:
        return None
    if found is None:
        return None
    path, v2 = found
    if not path.startswith("/") or path.startswith("/..") or "/../" in path:
        return None  # relative to a cgroup namespace: not placeable on the host's cgroupfs
    root, rel = cgroupfs_root(host_pid), path.lstrip("/")
    if v2:  # pure cgroup v2, or the unified hierarchy of a hybrid host
        candidates = [os.path.join(root, rel), os.path.join(root, "unified", rel)]
    else:
        candidates = [os.path.join(root, "freezer", rel)]
    for directory in candidates:
        control = os.path.join(directory, "cgroup.freeze" if v2 else "freezer.state")
        try:
            with open(os.path.join(directory, "cgroup.procs")) as f:
                listed = str(pid) in f.read().split()
        except OSError:
            continue
        if listed and os.path.exists(control):
            return CgroupFreezer(directory, v2)
    return None


def task_memory(pid: int) -> int:
    """Resident memory of every process in task `pid`'s cgroup (what a dump roughly writes), in bytes.

    The processes are those its freezer's cgroup lists (cgroup v1 and v2 alike); where that cannot be
    placed, the task alone. Anonymous and shared memory where the kernel tells them apart (RssAnon,
    RssShmem: file pages are not dumped), else VmRSS.
    """
    fz = lookup(pid)
    pids = [pid]
    if fz is not None:
        try:
            with open(os.path.join(fz.directory, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()] or [pid]
        except (OSError, ValueError):
            pass
    return sum(_rss(p) for p in pids)


def _rss(pid: int) -> int:
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssShmem") and value.split():
                    fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        return 0
    if "RssAnon" in fields:
        return fields["RssAnon"] + fields.get("RssShmem", 0)
    return fields.get("VmRSS", 0)
