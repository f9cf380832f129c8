"""Real overlayfs mounts for writable-layer tests (root only; skip cleanly otherwise)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Overlay:
    merged: Path
    upper: Path
    lower: Path


def require_overlay() -> None:
    if os.geteuid() != 0:
        pytest.skip("overlayfs mounts need root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount binaries missing")
    with open("/proc/filesystems") as f:
        if "overlay" not in f.read():
            pytest.skip("kernel has no overlayfs")


@contextmanager
def overlay_mount(lower: Path, base: Path, *, extra_options: str = "") -> Iterator[Overlay]:
    """Mount a fresh overlay of `lower` under `base` (upper, work, merged are created there)."""
    upper, work, merged = base / "upper", base / "work", base / "merged"
    for d in (upper, work, merged):
        d.mkdir(parents=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if extra_options:
        opts += "," + extra_options
    res = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(merged)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount overlayfs here: {res.stderr.strip()}")
    try:
        yield Overlay(merged=merged, upper=upper, lower=lower)
    finally:
        subprocess.run(["umount", str(merged)], check=True)
