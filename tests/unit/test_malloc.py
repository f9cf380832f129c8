"""shim/malloc.py: the settings reach glibc's mallopt (the test runs on glibc, as the agent image does)."""

from __future__ import annotations

import subprocess
import sys

from shim import malloc


def test_the_settings_are_accepted_by_glibc() -> None:
    # in a child: the settings change this process's allocator for good
    code = "from shim import malloc; raise SystemExit(0 if malloc.tune() else 1)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
    assert all(value > 0 for _, value in malloc.SETTINGS)
