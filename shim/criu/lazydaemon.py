"""CRIU's lazy-pages daemon for one restored container (docs/lazy-restore.md).

``criu lazy-pages --page-server --ps-socket FD -D IMAGES -W WORK`` listens on ``lazy-pages.socket`` in
WORK, where the restore's CRIU (its ``--work-path``, the same dir) hands it each task's userfaultfd; it
asks the page server at the other end of FD (a socketpair: no port another local process could reach)
for every page the tasks fault on, then for the rest in the background, and exits once all is copied
(0), or when the page server hung up or CRIU failed (not 0: the kernel then zero-fills what had not
come, so its supervisor must end the container, shim/engine/lazyrestore.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import time
from collections.abc import Sequence

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import CriuFailed, UnsafeArchive, log_tail

SOCKET_NAME = C.LAZY_PAGES_SOCKET  # CRIU's, in the work dir of both the daemon and the restore
LOG_NAME = C.LAZY_PAGES_LOG
LISTEN_TIMEOUT_S = 30.0


def listening(work_dir: str) -> bool:
    """A lazy-pages daemon's socket is in `work_dir` (a socket: nothing extracted from a layer is one)."""
    try:
        return stat.S_ISSOCK(os.lstat(os.path.join(work_dir, SOCKET_NAME)).st_mode)
    except OSError:
        return False


class LazyPagesDaemon:
    def __init__(self, criu: Sequence[str], images_dir: str, work_dir: str, ps_socket: socket.socket) -> None:
        self.work_dir = work_dir
        # the work dir came from the snapshot's layer: a file of these names there (a symlink, say) must
        # not receive the daemon's writes
        for name in (SOCKET_NAME, LOG_NAME):
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(work_dir, name))
            except OSError as e:
                raise UnsafeArchive(
                    f"the snapshot's layer holds {name} ({e.strerror})",
                    hint="the snapshot is corrupted or was crafted; do not restore it",
                ) from e
        cmd = [*criu, "lazy-pages", "--page-server", "--ps-socket", str(ps_socket.fileno()),
               "-D", images_dir, "-W", work_dir, "-o", LOG_NAME, "-v2"]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=work_dir,
            pass_fds=(ps_socket.fileno(),),
        )

    def wait_listening(self, timeout_s: float = LISTEN_TIMEOUT_S) -> None:
        """Return once the daemon listens for the restore; raises (and kills it) if it exits or never does."""
        deadline = time.monotonic() + timeout_s
        while not listening(self.work_dir):
            if self.proc.poll() is not None:
                raise CriuFailed(
                    f"criu lazy-pages exited {self.proc.returncode} before it listened; "
                    f"{LOG_NAME} tail:\n{self.log_tail()}",
                    hint="restore it eagerly (without --lazy); `criu check --feature uffd-noncoop` on the node",
                )
            if time.monotonic() > deadline:
                self.kill()
                raise CriuFailed(
                    f"criu lazy-pages did not listen within {timeout_s:.0f} s; {LOG_NAME} tail:\n{self.log_tail()}",
                    hint="restore it eagerly (without --lazy)",
                )
            time.sleep(0.01)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The daemon's exit status, or None while it still runs after `timeout_s`."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def log_tail(self, lines: int = 10, moved_to: str = "") -> str:
        """The tail of the daemon's log, in its work dir or where that was moved (`moved_to`)."""
        for d in (self.work_dir, moved_to):
            if not d:
                continue
            with contextlib.suppress(OSError), open(os.path.join(d, LOG_NAME), errors="replace") as f:
                return log_tail(f.read(), lines)
        return f"({LOG_NAME} unreadable)"
