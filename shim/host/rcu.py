"""Expedited RCU grace periods while this node's CRIU runs under runc (a dump, a restore).

CRIU under runc waits in the kernel for RCU grace periods that a raw CRIU of a host process does not:
most likely where it tears down mount namespaces (the container's, and its own service namespace;
mounts released wait for a grace period), not traced in the kernel. On the project's VMs (HZ=250,
lazy RCU) one such wait was 12-18 ms, inside the frozen window of every dump and on the way to every
restored container's start (bench/run.py, bench/freeze_breakdown.py --expedite-rcu). With ``/sys/kernel/rcu_expedited``
set to 1 the kernel expedites those waits (an IPI to the busy CPUs instead of waiting for each to
pass a quiescent state).

That switch is node-wide, so it is on only while one of this node's dumps or restores is in flight.
Each of them (the agent's dump, whether it runs ``runc checkpoint`` itself or containerd's runtime
runs it for the agent's Tasks.Checkpoint call, and the runtime wrapper's ``runc restore``: different
processes) holds a token in the node's directory (``<state dir>/rcu-expedite``) for as long as it runs:
the first token sets the switch, the last one puts it back. A token is a file its holder keeps
flock()ed: one whose lock can be taken belongs to a holder that is gone (killed, say) and is removed
by whoever looks next (each acquire and release, and the agent's start).

Left alone: a node whose switch was already on (someone else's setting: never put back), a node with
``rcu_normal`` set (it asks for normal grace periods, real-time nodes do), and a node whose directory
is missing: install-node creates it on every agent start unless the agent runs with
KUBECTL_SNAPSHOT_EXPEDITE_RCU=0, and removes it then. Nothing here can fail a dump or a restore: an
unwritable /sys (a container without it) or any other error only means normal grace periods.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator, Mapping

SYSFS = "/sys/kernel"
DIR_NAME = "rcu-expedite"
ENV = "KUBECTL_SNAPSHOT_EXPEDITE_RCU"  # "0": install-node removes the directory, nothing is switched
_LOCK, _OURS, _TOKEN = ".lock", ".set-by-kubectl-snapshot", "t-"


def directory(state_dir: str) -> str:
    return os.path.join(state_dir, DIR_NAME)


def enabled(env: Mapping[str, str]) -> bool:
    return env.get(ENV, "1").strip() != "0"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _locked(d: str) -> Iterator[None]:
    fd = os.open(os.path.join(d, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _live_tokens(d: str) -> int:
    """The tokens whose holder still runs; the others are removed."""
    live = 0
    for name in os.listdir(d):
        if not name.startswith(_TOKEN):
            continue
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                live += 1
            continue
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)  # its holder is gone
    return live


def _put_back(d: str, sysfs: str) -> bool:
    """With no live token left: the switch back to 0 if this directory's holders set it. True if reset."""
    ours = os.path.join(d, _OURS)
    if not os.path.exists(ours) or _live_tokens(d):
        return False
    reset = _read(os.path.join(sysfs, "rcu_expedited")) == "1" and _write(os.path.join(sysfs, "rcu_expedited"), "0")
    with contextlib.suppress(OSError):
        os.unlink(ours)
    return reset


class Token:
    """One holder's token: release() ends it (idempotent)."""

    def __init__(self, d: str, sysfs: str, fd: int, path: str, switched: bool) -> None:
        self.dir, self.sysfs, self._fd, self._path = d, sysfs, fd, path
        self.switched = switched  # this token turned the switch on

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            with _locked(self.dir):
                with contextlib.suppress(OSError):
                    os.unlink(self._path)
                os.close(self._fd)
                self._fd = -1
                _put_back(self.dir, self.sysfs)
        except OSError:
            if self._fd >= 0:
                os.close(self._fd)  # the lock goes with it: the next holder removes the token
                self._fd = -1


def acquire(state_dir: str, sysfs: str = SYSFS) -> Token | None:
    """A token for one runc run; None where this node does not expedite (no directory) or on any error."""
    d = directory(state_dir)
    try:
        with _locked(d):
            path = os.path.join(d, _TOKEN + os.urandom(8).hex())
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            switched = False
            if _live_tokens(d) == 1 and not os.path.exists(os.path.join(d, _OURS)):
                current = _read(os.path.join(sysfs, "rcu_expedited"))
                normal = _read(os.path.join(sysfs, "rcu_normal")) in ("", "0")
                if current == "0" and normal and _write(os.path.join(sysfs, "rcu_expedited"), "1"):
                    with open(os.path.join(d, _OURS), "w"):
                        pass
                    switched = True
            return Token(d, sysfs, fd, path, switched)
    except OSError:
        return None


@contextlib.contextmanager
def expedited(state_dir: str | None, sysfs: str = SYSFS) -> Iterator[Token | None]:
    """Expedited grace periods for the duration of the block (see the module's doc)."""
    token = acquire(state_dir, sysfs) if state_dir else None
    try:
        yield token
    finally:
        if token is not None:
            token.release()


def prepare(state_dir: str, *, enable: bool, sysfs: str = SYSFS) -> str:
    """install-node's part, on every agent start: the directory exists exactly when `enable`; a switch
    left on by holders that are gone is put back. Returns what it found, for the install's report."""
    d = directory(state_dir)
    if enable:
        os.makedirs(d, mode=0o700, exist_ok=True)
    elif not os.path.isdir(d):
        return "off"
    with _locked(d):
        reset = _put_back(d, sysfs)
    if not enable:
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        return "off (put back)" if reset else "off"
    if _read(os.path.join(sysfs, "rcu_normal")) not in ("", "0"):
        state = "left alone: rcu_normal is set"
    elif _read(os.path.join(sysfs, "rcu_expedited")) == "1":
        state = "left alone: already on"
    else:
        state = "during dumps and restores"
    return state + (" (a leftover put back)" if reset else "")
