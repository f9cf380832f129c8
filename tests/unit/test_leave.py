"""console/leave.py: a quick exit keeps the exit status, the output and the exit handlers; it waits for a
running thread as a normal exit would. Each case is a real child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kubectl_snapshot.console.leave import exit_code


def _child(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (3, 3), (True, 1), (256 + 7, 7)])
def test_exit_code_maps_like_cpython(code: object, status: int) -> None:
    assert exit_code(code) == status


def test_status_output_and_exit_handlers_survive(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    proc = _child(
        f"""
        import atexit, sys, tempfile, weakref
        from kubectl_snapshot.console import leave

        def main():
            atexit.register(lambda: open({str(marker)!r}, "w").write("atexit"))
            d = tempfile.TemporaryDirectory()  # cleaned by weakref.finalize at exit
            print(d.name, end="")              # buffered: must be flushed
            sys.stderr.write("to stderr")
            sys.exit(4)

        leave.run(main)
        """,
        tmp_path,
    )
    assert proc.returncode == 4
    assert proc.stderr.endswith("to stderr")
    assert marker.read_text() == "atexit"
    assert proc.stdout and not Path(proc.stdout).exists()


def test_message_exit_and_normal_return(tmp_path: Path) -> None:
    proc = _child("from kubectl_snapshot.console import leave\nleave.run(lambda: exit('bad input'))\n", tmp_path)
    assert (proc.returncode, proc.stderr.strip()) == (1, "bad input")
    proc = _child("from kubectl_snapshot.console import leave\nleave.run(lambda: print('ok'))\n", tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "ok\n")


def test_waits_for_a_running_thread(tmp_path: Path) -> None:
    marker = tmp_path / "thread-done"
    proc = _child(
        f"""
        import threading, time
        from kubectl_snapshot.console import leave

        def work():
            time.sleep(0.5)
            open({str(marker)!r}, "w").write("done")

        leave.run(lambda: threading.Thread(target=work).start())
        """,
        tmp_path,
    )
    assert proc.returncode == 0
    assert marker.read_text() == "done"


def test_output_that_cannot_be_written_is_not_success(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        "import sys\nfrom kubectl_snapshot.console import leave\nleave.run(lambda: sys.stdout.write('x'))\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader went away (`| head`): the write or the final flush fails
    assert proc.wait(timeout=60) != 0  # 1 (BrokenPipeError) unbuffered, 120 buffered, as CPython's own exit
