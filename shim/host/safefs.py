"""Files in directories a tenant can write to, reached without ever following a link.

The agent is root on the node; a pod's volume directories (the gate emptyDir, the emptyDirs it
restores or captures) are writable by the pod's containers, which may plant symlinks there at any
time (an init container, a native sidecar, an ephemeral container). Every path below such a
directory is therefore opened here relative to a directory fd with ``openat2(RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`` (Linux 5.6+, through ``syscall(437)``: Python has no
binding), or, where openat2 is missing, component by component with ``O_NOFOLLOW`` (and
``O_DIRECTORY`` for every parent), which refuses the same links. Names that would leave the
directory (``..``, absolute) are refused before any syscall. New files are created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` under a fresh name and renamed into place inside the same
directory fd, so a link planted at the final name is replaced, never written through.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import secrets
import socket
import stat
import struct
from collections.abc import Iterator

from kubectl_snapshot.core.errors import PermissionDenied

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_FLAGS = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
# openat2 has the same number on every architecture that came after the syscall table unification.
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HINT = (
    "a link or an unexpected entry in the pod's volume points outside it; the agent never follows "
    "those. Remove it (or recreate the pod) and try again"
)

_libc: ctypes.CDLL | None = None
_openat2_state: bool | None = None  # None: not probed yet


class UnsafePath(PermissionDenied):
    """A path below a tenant-writable directory is a link, not a directory, or escapes it."""


def _unsafe(rel: str, why: str) -> UnsafePath:
    return UnsafePath(f"refusing {rel!r} in a pod volume: {why}", hint=_HINT)


def split_relative(rel: str) -> list[str]:
    """`a/b/c` -> ['a', 'b', 'c']; refuses absolute names, '..' and NUL (nothing may leave the root)."""
    if "\x00" in rel:
        raise _unsafe(rel, "NUL byte in name")
    if rel.startswith("/"):
        raise _unsafe(rel, "absolute path")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _unsafe(rel, "'..' component")
    return parts


def _openat2_raw(dir_fd: int, rel: str, flags: int, mode: int, resolve: int) -> int:
    assert _libc is not None
    if not flags & os.O_CREAT:
        mode = 0  # openat2 refuses a mode without O_CREAT (EINVAL)
    how = struct.pack("QQQ", flags | os.O_CLOEXEC, mode, resolve)
    buf = ctypes.create_string_buffer(how, len(how))
    nr = _SYS_OPENAT2[platform.machine()]
    fd = _libc.syscall(
        ctypes.c_long(nr), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(rel)), buf, ctypes.c_size_t(len(how))
    )
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), rel)
    return int(fd)


def openat2_available() -> bool:
    """True when this kernel and architecture offer openat2 (probed once)."""
    global _libc, _openat2_state
    if _openat2_state is None:
        _openat2_state = False
        if platform.machine() in _SYS_OPENAT2 and os.environ.get("KUBECTL_SNAPSHOT_NO_OPENAT2") != "1":
            try:
                _libc = ctypes.CDLL(None, use_errno=True)
                fd = _openat2_raw(os.open("/", _DIR), ".", _DIR, 0, RESOLVE_FLAGS)
                os.close(fd)
                _openat2_state = True
            except (OSError, AttributeError):
                _openat2_state = False
    return _openat2_state


def _explain(rel: str, e: OSError) -> OSError | UnsafePath:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return _unsafe(rel, "a component is a symlink or not a directory")
    if e.errno == errno.EXDEV:
        return _unsafe(rel, "it resolves outside the directory")
    return e


def open_beneath(
    dir_fd: int, rel: str, flags: int = _DIR, mode: int = 0o600, *, use_openat2: bool | None = None
) -> int:
    """An fd for `rel` below `dir_fd`; no component (the last included) may be a symlink.

    Raises UnsafePath for links, escapes and non-directory parents; FileNotFoundError etc. as usual.
    """
    parts = split_relative(rel)
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if use_openat2 is None:
        use_openat2 = openat2_available()
    try:
        if use_openat2:
            return _openat2_raw(dir_fd, "/".join(parts) or ".", flags, mode, RESOLVE_FLAGS)
        return _walk_nofollow(dir_fd, parts, flags, mode)
    except OSError as e:
        raise _explain(rel, e) from e


def _walk_nofollow(dir_fd: int, parts: list[str], flags: int, mode: int) -> int:
    if not parts:
        return os.open(".", flags, mode, dir_fd=dir_fd)
    fd = os.dup(dir_fd)
    try:
        for comp in parts[:-1]:
            nfd = os.open(comp, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return os.open(parts[-1], flags, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_dir(root: str, rel: str, *, use_openat2: bool | None = None) -> int:
    """Open directory `root/rel`: `root` is a trusted host path (e.g. the kubelet's root dir, followed
    as configured), everything in `rel` is resolved without links."""
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return open_beneath(rfd, rel, _DIR, use_openat2=use_openat2)
    finally:
        os.close(rfd)


@contextlib.contextmanager
def opened_dir(root: str, rel: str, *, use_openat2: bool | None = None) -> Iterator[int]:
    fd = open_dir(root, rel, use_openat2=use_openat2)
    try:
        yield fd
    finally:
        os.close(fd)


def write_file(dir_fd: int, name: str, data: bytes, *, mode: int = 0o644) -> None:
    """Atomically (re)place the regular file `name` directly in `dir_fd`, never writing through a link.

    The data goes to a new, randomly named file created with O_EXCL|O_NOFOLLOW, then renamed over
    `name` inside the same directory: rename replaces whatever entry `name` was (a planted symlink
    included) without following it. A directory at `name` is refused.
    """
    if "/" in name or name in ("", ".", ".."):
        raise _unsafe(name, "not a plain file name")
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(e, IsADirectoryError):
            raise _unsafe(name, "a directory is in the way") from e
        raise


def read_file(dir_fd: int, rel: str, *, limit: int = 1 << 20) -> bytes:
    """The first `limit` bytes of the regular file `rel` below dir_fd (no link followed)."""
    fd = open_beneath(dir_fd, rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _unsafe(rel, "not a regular file")
        out = b""
        while len(out) < limit and (chunk := os.read(fd, min(1 << 16, limit - len(out)))):
            out += chunk
        return out
    finally:
        os.close(fd)


SUN_PATH_MAX = 107  # sockaddr_un's sun_path, less its terminating NUL


def listen_unix(path: str, backlog: int) -> socket.socket:
    """A listening Unix socket at `path` that only its owner can connect to (a stale socket there is
    replaced). The umask is set around bind so the socket never exists with wider permissions; it is
    process-wide, so call this before other threads create files. The socket is bound under a
    temporary name and renamed to `path` once it listens: whoever waits for `path` to exist (a freeze
    guard's client) never connects between bind and listen (ECONNREFUSED)."""
    tmp = path + ".new"
    if len(os.fsencode(tmp)) > SUN_PATH_MAX:
        tmp = path  # no room for the temporary name: bound in place, as the name allows
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o077)
        try:
            srv.bind(tmp)
        finally:
            os.umask(old)
        srv.listen(backlog)
        if tmp != path:
            os.rename(tmp, path)  # replaces a stale socket at once
    except BaseException:
        srv.close()
        with contextlib.suppress(OSError):
            if tmp != path:
                os.unlink(tmp)
        raise
    return srv
