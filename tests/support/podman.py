"""podman (Debian's 5.4, hack/install-bench-deps.sh) and checkpointctl (hack/build-go-tool.sh) for the
tests that hand an export to the tools users run: podman restores it, checkpointctl reads it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PODMAN_ENV = {**os.environ, "PODMAN_IGNORE_CGROUPSV1_WARNING": "1"}
# runc and cgroupfs, as bench/ runs podman on this VM (crun refuses cgroup v1 hybrid: PLATFORM.md)
PODMAN_GLOBAL = ["--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]


def require_podman() -> None:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (hack/install-bench-deps.sh installs Debian's)")


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *PODMAN_GLOBAL, *args], capture_output=True, text=True, timeout=timeout, env=PODMAN_ENV
    )
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def checkpointctl_bin() -> str:
    """checkpointctl built from the Go module proxy, cached by version."""
    proc = subprocess.run(
        [str(REPO / "hack/build-go-tool.sh"), "checkpointctl"], capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        pytest.skip(f"checkpointctl could not be built: {proc.stderr[-500:]}")
    return str(Path(proc.stdout.strip()) / "checkpointctl")


def restore_flags(stderr: str) -> list[str]:
    """The flags the export's hint names for `podman container restore --import FILE`."""
    line = next(ln for ln in stderr.splitlines() if "podman container restore --import" in ln)
    return line.split("--import", 1)[1].split()[1:]


def podman_read(name: str, path: str = "/tmp/count") -> tuple[str, int]:
    """The counter's token and count in podman's container `name`."""
    out = podman("exec", name, "cat", path).stdout.split()
    return out[0], int(out[1])
