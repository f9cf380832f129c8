"""Leaving a one-shot command quickly: exit handlers, flushed output, then `os._exit`.

When a command's work is done, CPython still tears its interpreter down: it clears every module (the
agent imports ~600: grpc, requests, cryptography, click...), collects their cycles and finalizes C
extensions. That work serves nothing the user asked for, and after a small pod's checkpoint it is a
visible part of what the command costs beyond the agent's own work (`bench/run.py`'s CLI time against its
"in-agent" time). The operating system frees
a process's memory and closes its files and sockets at once.

So a program's entry point runs its `main`, then `leave()`: atexit handlers run as they would at a normal
exit (logging's flush, `weakref.finalize` of temporary directories, anything a library registered),
stdout and stderr are flushed, and the process ends with its exit code. Where a thread other than the main
one (and not a daemon) is still running, a normal exit waits for it: then `leave()` falls back to
`sys.exit` and loses nothing. Only the entry points use this; code that calls `main` in-process (tests,
click's runner) gets ordinary `SystemExit`.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)
if TYPE_CHECKING:
    from typing import NoReturn


def exit_code(code: object) -> int:
    """`SystemExit.code` as a process exit status, as CPython maps it (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush() -> int:
    """Flush stdout and stderr; 120 (CPython's status for an unflushable stdout) if writing fails."""
    status = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            status = 120
    return status


def _other_threads_running() -> bool:
    main = threading.main_thread()
    return any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate())


def leave(code: int) -> NoReturn:
    """End the process with `code` after the exit handlers, without the interpreter's teardown."""
    if _other_threads_running():
        sys.exit(code)  # CPython joins them first; so must we
    atexit._run_exitfuncs()
    flushed = _flush()
    os._exit(code or flushed)


def run(main: Callable[[], object]) -> NoReturn:
    """Run an entry point's `main` and leave with its exit status. Exceptions other than SystemExit
    (a bug's traceback, Ctrl-C) take the ordinary path: they print and exit as they always did."""
    try:
        main()
    except SystemExit as e:
        leave(exit_code(e.code))
    leave(0)
