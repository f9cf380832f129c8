"""The agent's scratch is root's alone: directories 0700, files 0600, the dump's programs under umask 077.

A dump holds a pod's memory (its keys, its tokens, what its users typed) and its writable layer; the
agent's state dir and memory work area hold them until they are packaged and removed. The node's other
users (a host agent, a debugging shell under another uid, a container that shares a host directory) must
never read them, however briefly. Permissions are set where each entry is created, never fixed after:

- `makedirs` creates every missing component with mode 0700 (``os.makedirs`` gives the intermediate
  ones the process's default mode, 0755 under the usual umask);
- `create` opens a new file with ``O_CREAT|O_TRUNC|O_NOFOLLOW`` and mode 0600 (``open(path, "w")``
  gives 0644), and refuses a link planted at its name;
- `UMASK` is handed to runc (and through it CRIU, its tar and everything they write: images, dump.log,
  runc's descriptors) with ``subprocess``'s ``umask=``: no process-wide umask is changed, so the agent's
  other writes (a restored rootfs, whose modes are the workload's) are not affected;
- `tighten` takes group and other bits off a dump that containerd's shim wrote (ks-agent's own command
  goes through containerd's Tasks.Checkpoint, whose runc has the runtime's umask).
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False  # the runtime wrapper creates its markers with this: typing is not imported at run time
if TYPE_CHECKING:
    from typing import IO

UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def makedirs(path: str) -> None:
    """`path` and every missing directory above it, each created 0700 (existing ones are left as they are)."""
    parent = os.path.dirname(os.path.normpath(path))
    if parent and parent != path and not os.path.isdir(parent):
        makedirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return
    os.chmod(path, DIR_MODE)  # whatever the process's umask took away, nothing more is granted


def create(path: str) -> IO[str]:
    """A new (or truncated) text file at `path`, mode 0600, never through a link."""
    return os.fdopen(_open(path), "w")


def create_binary(path: str) -> IO[bytes]:
    """As `create`, binary."""
    return os.fdopen(_open(path), "wb")


def _open(path: str) -> int:
    fd = os.open(path, _CREATE, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # an existing file keeps its old mode under O_CREAT: made private too
    except BaseException:
        os.close(fd)
        raise
    return fd


def restrict_top(root: str) -> None:
    """`root` and the directories directly in it made 0700 (what an older agent made 0755): everything
    below them is then out of reach of the node's other users, whatever its own mode (a restored rootfs
    keeps the workload's)."""
    for path in [root, *(os.path.join(root, e) for e in os.listdir(root))]:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o077:
            os.chmod(path, DIR_MODE)


def tighten(top: str) -> None:
    """Take every group and other permission off what is below `top` (links are left alone).

    For a dump written by a runc we do not start (containerd's Tasks.Checkpoint: ks-agent's own
    checkpoint command), whose CRIU creates its images 0644 under the runtime's umask: they were never
    reachable through the 0700 directories above them, and are made 0600 as soon as the dump returns."""
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
