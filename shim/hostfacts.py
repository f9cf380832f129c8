"""Facts about this node recorded in every snapshot and checked by a restore preflight."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess

from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.model import HostFacts

_INTERESTING_CPU_FLAGS = ("avx", "avx2", "avx512f", "sse4_2", "aes", "sha_ni", "xsave", "xsaves", "fma")


def find_binary(name: str, *, extra_dirs: tuple[str, ...] = ("/usr/sbin", "/usr/local/sbin", "/sbin")) -> str:
    path = shutil.which(name) or next(
        (os.path.join(d, name) for d in extra_dirs if os.access(os.path.join(d, name), os.X_OK)), None
    )
    if path is None:
        raise FailedPrecondition(
            f"{name} is not installed on this node",
            hint="run hack/install-node-deps.sh (CRIU 4.2.1, runc and containerd)",
        )
    return path


def _version_of(cmd: list[str], pattern: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    m = re.search(pattern, out)
    return m.group(1) if m else ""


def criu_version() -> str:
    try:
        criu = find_binary("criu")
    except FailedPrecondition:
        return ""
    return _version_of([criu, "--version"], r"Version:\s*(\S+)")


def runc_version() -> str:
    try:
        runc = find_binary("runc")
    except FailedPrecondition:
        return ""
    return _version_of([runc, "--version"], r"runc version\s+(\S+)")


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


def gather(containerd_version: str = "") -> HostFacts:
    return HostFacts(
        kernel=platform.release(),
        arch=platform.machine(),
        criu_version=criu_version(),
        containerd_version=containerd_version,
        runc_version=runc_version(),
        cgroup_version=cgroup_version(),
        cpu_flags=cpu_flags(),
    )


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
