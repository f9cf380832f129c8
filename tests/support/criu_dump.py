"""A real process tree dumped by the real ``criu dump`` (root; skips cleanly without criu)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TOUCHED_BYTES = 20 << 20

_WORKLOAD = textwrap.dedent(
    """
    import os, sys, threading, time
    def name(n):
        with open("/proc/self/comm", "w") as f:
            f.write(n)
    name("snap-parent")
    buf = bytearray(int(sys.argv[2]))
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    if os.fork() == 0:
        name("snap-child")
        time.sleep(3600)
        os._exit(0)
    time.sleep(0.2)
    open(sys.argv[1], "w").close()
    time.sleep(3600)
    """
)


@dataclass(frozen=True)
class Dumped:
    images_dir: Path
    pid: int


def require_criu() -> str:
    if os.geteuid() != 0:
        pytest.skip("criu dump needs root")
    criu = shutil.which("criu") or ("/usr/sbin/criu" if os.path.exists("/usr/sbin/criu") else None)
    if criu is None:
        pytest.skip("criu is not installed (run hack/install-node-deps.sh)")
    return criu


def dump_workload(tmp_path: Path, script: str, *args: str) -> Iterator[Dumped]:
    """Run `script` (python -c, in a session of its own; it creates the file named by its first argument
    when ready, `args` follow), dump it with `criu dump -v4`, yield the images; the process is killed after."""
    criu = require_criu()
    ready = tmp_path / "ready"
    images = tmp_path / "images"
    images.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(ready), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read() if proc.stderr and proc.poll() is not None else b""
                pytest.fail(f"workload did not start (exit {proc.poll()}): {err!r}")
            time.sleep(0.05)
        res = subprocess.run(
            [criu, "dump", "-t", str(proc.pid), "-D", str(images), "-v4", "-o", "dump.log"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if res.returncode != 0:
            log = (images / "dump.log").read_text(errors="replace")[-3000:]
            pytest.fail(f"criu dump failed ({res.returncode}): {res.stderr}\n{log}")
        yield Dumped(images_dir=images, pid=proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)


@pytest.fixture
def criu_dumped(tmp_path: Path) -> Iterator[Dumped]:
    """A session-leader python process (two threads, ~20 MiB touched) with one child, dumped with -v4."""
    yield from dump_workload(tmp_path, _WORKLOAD, str(TOUCHED_BYTES))
