"""The node bundle's static launcher (launcher) as the benchmarks build and read it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

NATIVE_TAR_ENV = "KUBECTL_SNAPSHOT_NATIVE_TAR"  # "0": CRIU's tmpfs calls all go to GNU tar (tmpfstar.go)


def build(dest: Path) -> bool:
    """Build launcher at `dest`; False where there is no Go to build it with."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not os.path.exists(go):
        return False
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    dest.parent.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([go, "build", "-trimpath", "-o", str(dest), "."], cwd=repo / "launcher", env=env, check=True)
    return True


def build_tar(dest: Path, gnu_tar: str, log: Path) -> bool:
    """The launcher as the node bundle's ``bin/tar``: GNU tar (`gnu_tar`) behind it, its record of each
    call in `log`, as install-node configures it."""
    if not build(dest):
        return False
    Path(f"{dest}.launch").write_text(json.dumps({"argv": [gnu_tar], "gzipFilter": True, "log": str(log)}))
    return True


def launch_time(stamp: str) -> float:
    """The launcher's RFC 3339 time (nanoseconds, Z) as a POSIX time."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp() + float("0." + (frac or "0"))
