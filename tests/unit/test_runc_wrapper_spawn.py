"""The hook's `runc restore` child (runc_wrapper.run_waited): subprocess.run's exit status and
descriptors, without importing subprocess on the hook's way to runc."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from shim.runtime_wrapper import run_waited

PY = sys.executable


def test_exit_status_and_environment(tmp_path: Path) -> None:
    code = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('KS_X', '-')); sys.exit(7)"
    out = tmp_path / "env"
    assert run_waited([PY, "-c", code, str(out)], {"KS_X": "given"}) == 7
    assert out.read_text() == "given"
    os.environ["KS_X"] = "inherited"
    try:
        assert run_waited([PY, "-c", code, str(out)], None) == 7
    finally:
        del os.environ["KS_X"]
    assert out.read_text() == "inherited"


def test_a_signal_is_a_negative_status() -> None:
    assert run_waited([PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], None) == -signal.SIGKILL


def test_only_stdio_is_inherited_and_sigpipe_and_sigxfsz_are_the_defaults(tmp_path: Path) -> None:
    """As subprocess's close_fds and restore_signals: runc gets the shim's stdio, no descriptor of the
    hook's, and SIGPIPE and SIGXFSZ as the defaults (Python ignores them; an ignored signal stays ignored
    across exec)."""
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN  # this Python's, as the hook's
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    r, w = os.pipe()
    os.set_inheritable(w, True)  # what a descriptor passed down (not close-on-exec) looks like
    out = tmp_path / "seen"
    # the shell execs cat: /proc/self is the program runc would be, as run_waited left it
    script = f"ls /proc/$$/fd > {out}.fds; exec cat /proc/self/status > {out}"
    try:
        assert run_waited(["/bin/sh", "-c", script], None) == 0
    finally:
        os.close(r)
        os.close(w)
    fds = {int(f) for f in Path(f"{out}.fds").read_text().split()}
    assert w not in fds and r not in fds
    ignored = int(next(line for line in out.read_text().splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)) and not ignored & (1 << (signal.SIGXFSZ - 1))


def test_a_program_that_cannot_be_run_is_127(tmp_path: Path) -> None:
    assert run_waited([str(tmp_path / "missing")], None) == 127
