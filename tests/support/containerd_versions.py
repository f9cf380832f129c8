"""Which containerd a test daemon runs: the installed one (/usr/local/bin, v2.3.x) or another release
built from the Go module proxy by hack/build-containerd.sh (cached by version).

``ContainerdBinaries`` names the three binaries of one release and the config format that release
reads: containerd 1.7 reads config version 2 only ("unsupported config version `3`"), 2.x reads 3.
``OTHER_VERSIONS`` are the releases the version matrix tests (docs/deploy.md, "Supported containerd
versions"): the newest patch of every release line still supported upstream besides the installed one.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "hack" / "build-containerd.sh"
INSTALLED_DIR = "/usr/local/bin"
INSTALLED_VERSION = "v2.3.7"  # hack/install-node-deps.sh's CONTAINERD_VERSION
OTHER_VERSIONS = ("v1.7.35", "v2.0.14", "v2.1.9", "v2.2.9")
BUILD_TIMEOUT = 1800.0


@dataclass(frozen=True)
class ContainerdBinaries:
    """containerd, its runc shim and ctr of one release, all in `bin_dir`."""

    bin_dir: str
    version: str  # "" for the installed binaries (whatever install-node-deps.sh put there)

    @property
    def containerd(self) -> str:
        return os.path.join(self.bin_dir, "containerd")

    @property
    def shim(self) -> str:
        return os.path.join(self.bin_dir, "containerd-shim-runc-v2")

    @property
    def ctr(self) -> str:
        return os.path.join(self.bin_dir, "ctr")

    @property
    def config_version(self) -> int:
        return 2 if self.version.startswith("v1.") else 3

    @property
    def label(self) -> str:
        return self.version or "installed"


INSTALLED = ContainerdBinaries(INSTALLED_DIR, "")


def built(version: str) -> ContainerdBinaries:
    """The binaries of `version`, built by hack/build-containerd.sh when not cached yet (minutes).

    Skips when Go is missing (hack/install-node-deps.sh installs it); a failed build fails the test.
    """
    env = {**os.environ, "PATH": "/usr/local/go/bin:" + os.environ.get("PATH", "/usr/bin:/bin")}
    cached = subprocess.run([BUILD_SCRIPT, "--check", version], capture_output=True, text=True, check=False, env=env)
    if cached.returncode != 0 and not any(os.access(os.path.join(d, "go"), os.X_OK) for d in env["PATH"].split(":")):
        pytest.skip(f"containerd {version} is not built and Go is missing (hack/build-containerd.sh {version})")
    proc = cached
    if cached.returncode != 0:
        proc = subprocess.run(
            [BUILD_SCRIPT, version], capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False, env=env
        )
        if proc.returncode != 0:
            pytest.fail(f"hack/build-containerd.sh {version} failed:\n{proc.stderr[-3000:]}")
    return ContainerdBinaries(proc.stdout.strip(), version)
