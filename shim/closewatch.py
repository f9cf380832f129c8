"""Which files of one directory were closed after being written: inotify's IN_CLOSE_WRITE.

Why: CRIU writes a process's page file and its pagemap while the rest of the dump (the mount and
network namespaces, the unlock, runc's own work) still runs for tens of ms; once both are closed they
are final (CRIU opens every image once and never reopens it). The agent compresses them on an idle
core meanwhile (shim/engine/packahead.py). inotify reports a close by the kernel, whoever closed the
file and through whichever mount: nothing a tenant writes (a log line, a file name) can fake it.

Python has no inotify binding: the three libc calls through ctypes. Anything unavailable (no libc,
the instance limit reached) raises OSError, and the caller does without.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct

IN_CLOSE_WRITE = 0x00000008
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of NUL-padded name)

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


class CloseWatch:
    """IN_CLOSE_WRITE events of the files directly in `directory`, from the moment it is created."""

    def __init__(self, directory: str) -> None:
        lib = _lib()
        fd = lib.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self._fd = fd
        wd = lib.inotify_add_watch(fd, os.fsencode(directory), IN_CLOSE_WRITE | IN_ONLYDIR)
        if wd < 0:
            e = ctypes.get_errno()
            os.close(fd)
            raise OSError(e, f"inotify_add_watch {directory}: {os.strerror(e)}")
        self.overflowed = False  # events were lost: the caller cannot tell which files are final

    def wait(self, timeout: float) -> list[str]:
        """Names closed after writing since the last call (waits up to `timeout` s for the first)."""
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if not ready:
            return []
        try:
            data = os.read(self._fd, 64 * 1024)
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                return []
            raise
        return self.parse(data)

    def parse(self, data: bytes) -> list[str]:
        names, pos = [], 0
        while pos + _EVENT.size <= len(data):
            _wd, mask, _cookie, n = _EVENT.unpack_from(data, pos)
            raw = data[pos + _EVENT.size : pos + _EVENT.size + n]
            pos += _EVENT.size + n
            if mask & IN_Q_OVERFLOW:
                self.overflowed = True
            elif mask & IN_CLOSE_WRITE and not mask & IN_IGNORED:
                name = raw.split(b"\0", 1)[0]
                if name:
                    names.append(os.fsdecode(name))
        return names

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> CloseWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
