"""Run a function inside another network namespace, in-process: no `nsenter`, no host tool.

A short-lived thread joins the namespace (``setns(2)`` with ``CLONE_NEWNET`` changes only the calling
thread), runs the function and ends; the caller's own threads never leave their namespace. Whatever
the function opens there (netlink and inet sockets, ``/proc/sys/net/...``, whose files are those of
the opening thread's namespace) belongs to that namespace. Used by the pod network locks
(shim/net/podrestore.py, shim/net/dumplock.py), the runtime wrapper's loopback bring-up and the Unix socket scan
(shim/net/unixpeers.py), so that the agent and the hook need nothing of the host's userland.
"""

from __future__ import annotations

import os
import threading

TYPE_CHECKING = False  # the runtime wrapper imports this: typing is not imported at run time
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    T = TypeVar("T")

CLONE_NEWNET = 0x40000000


def setns_net(fd: int) -> None:
    """Move the calling thread into the network namespace of `fd` (an open /proc/PID/ns/net)."""
    setns = getattr(os, "setns", None)  # Python >= 3.12
    if setns is not None:
        setns(fd, CLONE_NEWNET)
        return
    import ctypes  # only where os.setns is missing (the bundle's Python 3.11)

    libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc (the bundle's on a node)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def run_in(netns: str, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
    """`fn()` run by a thread that joined the namespace at path `netns` (/proc/PID/ns/net, /var/run/netns/X).

    Exceptions raised by `fn` (or by joining) are raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                setns_net(fd)  # this thread only: it ends when fn returns
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as e:  # reported in the caller's thread
            error.append(e)

    t = threading.Thread(target=work, name=f"netns-{os.path.basename(os.path.dirname(netns)) or netns}", daemon=True)
    t.start()
    t.join(timeout)
    if error:
        raise error[0]
    if not result:
        raise TimeoutError(f"work in network namespace {netns} did not finish within {timeout:.0f}s")
    return result[0]
