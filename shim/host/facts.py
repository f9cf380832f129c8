"""Facts about this node recorded in every snapshot and checked by a restore preflight."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.model import HostFacts

_INTERESTING_CPU_FLAGS = ("avx", "avx2", "avx512f", "sse4_2", "aes", "sha_ni", "xsave", "xsaves", "fma")


_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def find_binary_or_none(name: str, *, extra_dirs: tuple[str, ...] = _SBIN) -> str | None:
    return shutil.which(name) or next(
        (os.path.join(d, name) for d in extra_dirs if os.access(os.path.join(d, name), os.X_OK)), None
    )


def find_binary(name: str, *, extra_dirs: tuple[str, ...] = _SBIN) -> str:
    path = find_binary_or_none(name, extra_dirs=extra_dirs)
    if path is None:
        raise FailedPrecondition(
            f"{name} is not installed on this node",
            hint="run hack/install-node-deps.sh (CRIU 4.2.1, runc and containerd)",
        )
    return path


@dataclass(frozen=True)
class HostProbe:
    """How to run the host's tools: directly, or (from the agent's container) through nsenter."""

    exec_prefix: tuple[str, ...] = ()  # e.g. ("nsenter", "--mount=/proc/1/ns/mnt", "--")
    criu: str = "criu"
    runc: str = "runc"

    @classmethod
    def host_from_container(cls, *, criu: str = "criu", runc: str = "runc") -> HostProbe:
        """Through the host's mount namespace when this process is in another one, else directly."""
        pid = host_pid()
        prefix = ("nsenter", f"--mount=/proc/{pid}/ns/mnt", "--") if pid else ()
        return cls(prefix, criu, runc)

    def command(self, binary: str) -> list[str] | None:
        if self.exec_prefix:
            return [*self.exec_prefix, binary]
        try:
            return [find_binary(binary)]
        except FailedPrecondition:
            return None


_once = threading.local()  # host_pid_once(): this thread's answer while the block runs


@contextlib.contextmanager
def host_pid_once() -> Iterator[None]:
    """Within the block, host_pid() in this thread scans /proc at most once (the freeze guard places
    four cgroups per freeze: each scan of every process's cmdline is ~2 ms on a busy node)."""
    outer = getattr(_once, "scope", None)
    _once.scope = outer if outer is not None else {}
    try:
        yield
    finally:
        _once.scope = outer


def host_pid() -> int | None:
    """A process in the host's mount namespace, seen from a container with hostPID.

    PID 1 normally; where PID 1 is out of reach (some VMs protect their init), the node's
    containerd, which runs in the host's mount namespace by definition. None: not in a container.
    """
    scope: dict[str, int | None] | None = getattr(_once, "scope", None)
    if scope is not None:
        if "pid" not in scope:
            scope["pid"] = _host_pid()
        return scope["pid"]
    return _host_pid()


def find_host_pid() -> int | None:
    """host_pid(), looked up afresh (never this thread's remembered answer): the one it had may be gone."""
    return _host_pid()


_roots: dict[str, int] = {}  # the host's mount namespace (ns/mnt link) -> an O_PATH fd on its root
_roots_lock = threading.Lock()


def host_root() -> str | None:
    """The host's `/` as a path this process can use for as long as it runs; None: not in a container.

    /proc/PID/root of a host process (host_pid()) stops resolving the moment that process ends: the
    node's containerd, restarted by an install or an operator, took a restore down with ENOENT on the
    kubelet's root. This is `/proc/<this process>/fd/N` instead, N an fd held open on that root: the
    fd keeps the namespace's root reachable after the process is gone, and the mounts made there later
    (a memory-backed emptyDir) are seen through it. One fd per mount namespace ever found, for the
    agent's life; a process that ended between the lookup and the open is looked up again.
    """
    for attempt in range(3):
        pid = host_pid() if attempt == 0 else find_host_pid()
        if pid is None:
            return None
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
            with _roots_lock:
                fd = _roots.get(ns)
                if fd is None:
                    fd = _roots[ns] = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    # the process may have ended (and its pid been reused) between the two: the namespace
                    # is the one named only if the process still holds it
                    if os.readlink(f"/proc/{pid}/ns/mnt") != ns:
                        os.close(_roots.pop(ns))
                        continue
        except OSError:
            continue
        return f"/proc/{os.getpid()}/fd/{fd}"
    raise FailedPrecondition(
        "no process in the host's mount namespace stayed up long enough to reach the host's files",
        hint="the node's containerd restarts over and over? check it (systemctl status containerd) and retry",
    )


def _host_pid() -> int | None:
    try:
        mine = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return None
    with contextlib.suppress(OSError):
        if os.readlink("/proc/1/ns/mnt") != mine:
            return 1  # the first candidate below, without reading every process's command line
    candidates = [1]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv0 = f.read().split(b"\0", 1)[0]
            except OSError:
                continue
            if os.path.basename(argv0) == b"containerd":
                candidates.append(int(entry))
    for pid in candidates:
        try:
            if os.readlink(f"/proc/{pid}/ns/mnt") != mine:
                return pid
        except OSError:
            continue
    return None


def _version_of(cmd: list[str], pattern: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    m = re.search(pattern, out)
    return m.group(1) if m else ""


def criu_version(probe: HostProbe = HostProbe()) -> str:
    # The installed CRIU's launcher is at the same path in the agent's container: run it there, without
    # entering the host's mount namespace (and without any host tool).
    direct = os.path.isabs(probe.criu) and os.access(probe.criu, os.X_OK)
    cmd = [probe.criu] if direct else probe.command(probe.criu)
    return _version_of([*cmd, "--version"], r"Version:\s*(\S+)") if cmd else ""


def runc_version(probe: HostProbe = HostProbe()) -> str:
    cmd = probe.command(probe.runc)
    return _version_of([*cmd, "--version"], r"runc version\s+(\S+)") if cmd else ""


def cgroup_version() -> str:
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return "v2"
    if os.path.isdir("/sys/fs/cgroup/unified"):
        return "v1-hybrid"
    return "v1"


def cpu_flags() -> tuple[str, ...]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return tuple(x for x in _INTERESTING_CPU_FLAGS if x in flags)
    except OSError:
        pass
    return ()


def gather(containerd_version: str = "", probe: HostProbe = HostProbe()) -> HostFacts:
    return HostFacts(
        kernel=platform.release(),
        arch=platform.machine(),
        criu_version=criu_version(probe),
        containerd_version=containerd_version,
        runc_version=runc_version(probe),
        cgroup_version=cgroup_version(),
        cpu_flags=cpu_flags(),
    )


# A warm agent's checkpoints and restores record and check the node's facts each time; `criu --version`
# and `runc --version` are two processes, started on every request, whose answers change only when
# the node's CRIU or runc is replaced: by install-node, which every agent start runs (a new process
# asks afresh), or by hand, which the binaries' identity shows at once; the TTL bounds what is not
# looked at here (a launcher whose bundle changed behind it, tools run in the host's mount namespace).
FACTS_TTL_S = 60.0
_facts_lock = threading.Lock()
_facts: dict[tuple[str, HostProbe], tuple[float, tuple[tuple[str, int, int, int], ...], HostFacts]] = {}


def gather_cached(
    containerd_version: str = "", probe: HostProbe = HostProbe(), *, clock: Callable[[], float] = time.monotonic
) -> HostFacts:
    """gather(), remembered for up to FACTS_TTL_S while the CRIU and runc it ran are the same files; a
    node without one of them is asked every time (installing it must show at once)."""
    key = (containerd_version, probe)
    ident = _tools_identity(probe)
    now = clock()
    with _facts_lock:
        hit = _facts.get(key)
    if hit is not None and ident is not None and hit[1] == ident and 0 <= now - hit[0] < FACTS_TTL_S:
        return hit[2]
    facts = gather(containerd_version, probe)
    if ident is not None and facts.criu_version and facts.runc_version:
        with _facts_lock:
            _facts[key] = (now, ident, facts)
    return facts


def _tools_identity(probe: HostProbe) -> tuple[tuple[str, int, int, int], ...] | None:
    """Which files `criu` and `runc` are (path, inode, size, mtime; nothing to compare through nsenter),
    or None where one is not installed."""
    if probe.exec_prefix:
        return ()
    out = []
    for name in (probe.criu, probe.runc):
        path = name if os.path.isabs(name) else find_binary_or_none(name)
        if path is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        out.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def preflight_problems(snapshot: HostFacts, here: HostFacts) -> list[str]:
    """Reasons this node cannot restore a snapshot taken on `snapshot` (empty list: fine)."""
    problems = []
    if not here.criu_version:
        problems.append("CRIU is not installed on this node")
    if snapshot.arch and here.arch and snapshot.arch != here.arch:
        problems.append(f"the snapshot was taken on {snapshot.arch}, this node is {here.arch}")
    missing = sorted(set(snapshot.cpu_flags) - set(here.cpu_flags))
    if missing:
        problems.append(f"this node's CPU lacks features the snapshotted processes may use: {', '.join(missing)}")
    return problems
