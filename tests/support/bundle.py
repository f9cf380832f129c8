"""A node bundle for tests: the real one (hack/node_bundle.py from this machine) or a small fake."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def fake_bundle(out: Path, *, pyz: bytes = b"PK-bundled") -> Path:
    """A bundle.json-consistent tree whose programs are placeholders (for install logic only)."""
    files = {
        "lib/ld-linux-x86-64.so.2": b"loader",
        "lib/libc.so.6": b"libc",
        "libexec/criu": b"criu",
        "libexec/python3.11": b"python",
        "libexec/tar": b"tar",
        "kubectl-snapshot-runc.pyz": pyz,
        "launcher": b"\x7fELF launcher",
    }
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    digests = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    meta = {
        "loader": "lib/ld-linux-x86-64.so.2",
        "criu": {"path": "libexec/criu", "version": "4.2.1", "from": "debian criu 4.2.1-1"},
        "python": {"path": "libexec/python3.11", "version": "3.11.2", "from": "debian python3.11-minimal 3.11.2"},
        "tools": {
            "tar": {"path": "libexec/tar", "version": "1.34", "from": "debian tar 1.34+dfsg-1.2+deb12u1"},
        },
        "files": digests,
        "digest": hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest(),
    }
    (out / "bundle.json").write_text(json.dumps(meta))
    return out


def real_bundle(out: Path) -> Path:
    """The node bundle as the agent image carries it, built from this machine (needs CRIU 4.2.1, Go)."""
    work = out.parent / (out.name + "-parts")
    work.mkdir(parents=True, exist_ok=True)
    pyz, launcher = work / "kubectl-snapshot-runc.pyz", work / "launcher"
    subprocess.run(
        ["/usr/bin/python3", str(REPO / "hack/build-wrapper-pyz.py"), str(pyz)], check=True, capture_output=True
    )
    go = "/usr/local/go/bin/go"
    subprocess.run(
        [go, "build", "-trimpath", "-ldflags", "-s -w -buildid=", "-o", str(launcher), "."],
        cwd=REPO / "launcher",
        env={"CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "HOME": "/root", "PATH": "/usr/local/go/bin:/usr/bin:/bin"},
        check=True,
        capture_output=True,
    )
    script = str(REPO / "hack/node_bundle.py")
    site = sysconfig.get_paths()["purelib"]  # this venv's protobuf, as the agent image's venv has it
    subprocess.run(
        ["/usr/bin/python3", script, str(out), "--launcher", str(launcher), "--pyz", str(pyz), "--hook-site", site],
        check=True,
        capture_output=True,
    )
    return out
