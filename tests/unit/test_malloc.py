"""shim/host/malloc.py: the settings reach glibc's mallopt (the test runs on glibc, as the agent image does)."""

from __future__ import annotations

import subprocess
import sys

from shim.host import malloc


def test_the_settings_are_accepted_by_glibc() -> None:
    # in a child: the settings change this process's allocator for good
    code = "from shim.host import malloc; raise SystemExit(0 if malloc.tune() else 1)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
    assert all(value > 0 for _, value in malloc.SETTINGS)


def test_tuning_starts_no_process() -> None:
    """Every `ks-agent` command tunes malloc first: ctypes.util.find_library would run `ldconfig -p`."""
    code = (
        "import os, sys\n"
        "os.fork = os.posix_spawn = os.execv = os.execve = None  # any process start fails loudly\n"
        "from shim.host import malloc\n"
        "assert malloc.tune()\n"
        "assert 'ctypes.util' not in sys.modules and 'subprocess' not in sys.modules, sorted(sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
