"""Whole-pod restore on the node: one network lock around all of a pod's containers, all or nothing.

The kubelet creates a restored pod's containers one after the other, and the runtime wrapper turns
each ``create`` into a ``runc restore``. Two things go wrong when each container is restored on its
own:

- a TCP connection between two containers of the pod (over loopback) comes back on one end before
  the other end exists: the first end's retransmission or keepalive meets no socket, the kernel
  answers with a reset and the connection is dead by the time its peer is restored;
- when one container cannot be restored, the kubelet simply creates it again, from its image: the
  pod runs half restored, half fresh.

So the wrapper keeps per-pod state in the pod's staging directory (``by-pod/<uid>/``, written only by
the agent and the wrapper, never named by the pod):

``.containers.json``
    the pod's snapshotted container names, written by the agent when it stages the pod;
``.netlock``
    the pod's network namespace while it is locked: from before the first container is restored
    until the last one is, every packet in the namespace is dropped (an iptables chain that CRIU's own
    per-connection lock cannot undo); TCP retransmits whatever was dropped once it is released;
``.released``
    written when the lock was released (all containers restored);
``.failed``
    the reason, once any container of the pod could not be restored. From then on the wrapper
    refuses to create every snapshotted container of the pod, so none of them starts from scratch;
    the agent reports the failure and stops the containers already restored.

Connections that leave the pod cannot follow it to another node: their local address was the old pod
IP. CRIU binds them back and reconnects them in repair mode, and the kernel's route lookup for that
``connect`` refuses a source address that is not local ("Network is unreachable"), so before each
container is restored the wrapper lends the namespace the old addresses its sockets were bound to
(``ip addr add ADDR dev lo``, only those not already local, listed in ``.borrowed``) while the lock
is held. Before the lock is released the wrapper aborts every such connection (``ss -K``, an abort as
if a reset had come) and takes the borrowed addresses away again: the application sees
ECONNABORTED/ECONNRESET at once and reconnects.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

CONTAINERS_FILE = ".containers.json"
NETLOCK_FILE = ".netlock"
RELEASED_FILE = ".released"
FAILED_FILE = ".failed"
BORROWED_FILE = ".borrowed"
MUTEX_FILE = ".lock"
# A snapshotted container created again without staged data this soon after the pod's restore ended
# is a restored process that died at once: refused (the pod failed), not started from its image.
GRACE_S = 120.0

LOCK_CHAIN = "KUBECTL-SNAPSHOT-POD-LOCK"
_LOCK_RULES = (
    f"*filter\n:{LOCK_CHAIN} - [0:0]\n-A {LOCK_CHAIN} -j DROP\n"
    f"-I INPUT 1 -j {LOCK_CHAIN}\n-I OUTPUT 1 -j {LOCK_CHAIN}\nCOMMIT\n"
)
_UNLOCK_RULES = (
    f"*filter\n-D INPUT -j {LOCK_CHAIN}\n-D OUTPUT -j {LOCK_CHAIN}\n-F {LOCK_CHAIN}\n-X {LOCK_CHAIN}\nCOMMIT\n"
)
# TCP connections whose local end is not loopback: they were made from the old pod's address.
EXTERNAL_TCP_FILTER = "! src 127.0.0.0/8 and ! src [::1]"

# (argv, stdin) -> (exit status, output)
Runner = Callable[[list[str], str], tuple[int, str]]


_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run_command(argv: list[str], stdin: str) -> tuple[int, str]:
    # The node's own tools (nsenter, iptables-restore, ss), wherever containerd's PATH points.
    env = {**os.environ, "PATH": _SYSTEM_PATH + ":" + os.environ.get("PATH", "")}
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def lock_script() -> str:
    """Shell run inside the pod's netns: drop every packet, allow binds to the old pod address."""
    v4, v6 = shlex.quote(_LOCK_RULES), shlex.quote(_LOCK_RULES)
    return (
        "set -e; "
        f"printf %s {v4} | iptables-restore --noflush; "
        # IPv6 may be disabled in the namespace: then there is nothing to lock there.
        f"if [ -e /proc/sys/net/ipv6 ]; then printf %s {v6} | ip6tables-restore --noflush; fi; "
        "echo 1 > /proc/sys/net/ipv4/ip_nonlocal_bind; "
        "if [ -e /proc/sys/net/ipv6/ip_nonlocal_bind ]; then echo 1 > /proc/sys/net/ipv6/ip_nonlocal_bind; fi"
    )


def _with_prefix(address: str) -> str:
    return f"{address}/128" if ":" in address else f"{address}/32"


def borrow_script(addresses: list[str]) -> str:
    """Shell run inside the pod's netns: make each old address local (on lo) unless it already is.

    Prints the addresses it added (only those are taken away again)."""
    lines = []
    for a in addresses:
        q = shlex.quote(_with_prefix(a))
        nodad = " nodad" if ":" in a else ""
        lines.append(f'if [ -z "$(ip -o addr show to {q})" ]; then ip addr add {q} dev lo{nodad} && echo {q}; fi')
    return "set -e; " + "; ".join(lines) if lines else "true"


def unlock_script(borrowed: list[str] | None = None) -> str:
    """Abort connections from the old pod address, give borrowed addresses back, lift the lock."""
    rules = shlex.quote(_UNLOCK_RULES)
    give_back = "".join(f"ip addr del {shlex.quote(a)} dev lo; " for a in borrowed or [])
    return (
        f"ss -K -tnH state connected {shlex.quote(EXTERNAL_TCP_FILTER)} >/dev/null; "
        f"{give_back}"
        "echo 0 > /proc/sys/net/ipv4/ip_nonlocal_bind; "
        "if [ -e /proc/sys/net/ipv6/ip_nonlocal_bind ]; then echo 0 > /proc/sys/net/ipv6/ip_nonlocal_bind; fi; "
        f"printf %s {rules} | iptables-restore --noflush; rc=$?; "
        f"if [ -e /proc/sys/net/ipv6 ]; then printf %s {rules} | ip6tables-restore --noflush || rc=1; fi; "
        "exit $rc"
    )


def netns_of(spec: dict[str, object]) -> str | None:
    """The network namespace a container joins (a pod's), from its OCI spec; None if it owns one."""
    linux = spec.get("linux")
    namespaces = linux.get("namespaces") if isinstance(linux, dict) else None
    for ns in namespaces if isinstance(namespaces, list) else []:
        if isinstance(ns, dict) and ns.get("type") == "network":
            path = ns.get("path")
            return path if isinstance(path, str) and path else None
    return None


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


@dataclass(frozen=True)
class PodRestore:
    """One restored pod's state directory (``StatePaths.pod_dir(uid)``)."""

    directory: str
    run: Runner = run_command
    clock: Callable[[], float] = time.time

    def _p(self, name: str) -> str:
        return os.path.join(self.directory, name)

    # --- written by the agent -------------------------------------------------------------------

    def record(self, names: list[str]) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        _write(self._p(CONTAINERS_FILE), json.dumps(sorted(names)))

    def containers(self) -> list[str] | None:
        text = _read(self._p(CONTAINERS_FILE))
        if text is None:
            return None
        try:
            names = json.loads(text)
        except ValueError:
            return []
        return [str(n) for n in names] if isinstance(names, list) else []

    # --- shared -----------------------------------------------------------------------------------

    def failed(self) -> str | None:
        return _read(self._p(FAILED_FILE))

    def fail(self, reason: str) -> None:
        if self.failed() is None and os.path.isdir(self.directory):
            _write(self._p(FAILED_FILE), reason.strip() + "\n")

    @contextlib.contextmanager
    def mutex(self) -> Iterator[None]:
        """Serializes the wrapper's calls for one pod (the kubelet creates them one by one anyway)."""
        fd = os.open(self._p(MUTEX_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # --- the wrapper --------------------------------------------------------------------------------

    def refusal(self, name: str, has_staged: bool) -> str | None:
        """Why `create` of container `name` must not go ahead (None: go ahead)."""
        names = self.containers()
        if names is None or name not in names:
            return None  # not a snapshotted container of a restored pod
        why = self.failed()
        if why is not None:
            return f"the pod's restore failed, so container {name!r} is not started from scratch: {why.strip()}"
        if has_staged:
            return None
        released = _read(self._p(RELEASED_FILE))
        try:
            at = float(released) if released is not None else None
        except ValueError:
            at = None
        if at is not None and self.clock() - at > GRACE_S:
            return None  # restored long ago: an ordinary restart
        reason = (
            f"container {name!r} stopped right after it was restored, before the whole pod was running; "
            "it is not started again from its image (a restored pod comes back whole or not at all)"
        )
        self.fail(reason)
        return reason

    def lock(self, netns: str) -> None:
        """Lock the pod's network (once, before its first container is restored)."""
        if _read(self._p(NETLOCK_FILE)) is not None or _read(self._p(RELEASED_FILE)) is not None:
            return
        rc, out = self.run(["nsenter", f"--net={netns}", "sh", "-c", lock_script()], "")
        if rc != 0:
            raise OSError(f"locking the pod's network failed (exit {rc}): {out[-500:]}")
        _write(self._p(NETLOCK_FILE), netns)

    def borrowed(self) -> list[str]:
        text = _read(self._p(BORROWED_FILE))
        try:
            names = json.loads(text) if text else []
        except ValueError:
            return []
        return [str(n) for n in names] if isinstance(names, list) else []

    def borrow(self, netns: str, addresses: list[str]) -> None:
        """Make the old pod addresses of a container's sockets local while the pod is locked."""
        if not addresses:
            return
        rc, out = self.run(["nsenter", f"--net={netns}", "sh", "-c", borrow_script(addresses)], "")
        added = [line.strip() for line in out.splitlines() if "/" in line and " " not in line.strip()]
        if added:
            _write(self._p(BORROWED_FILE), json.dumps(sorted(set(self.borrowed()) | set(added))))
        if rc != 0:
            raise OSError(
                f"adding the old pod addresses {', '.join(addresses)} to the pod's network failed "
                f"(exit {rc}): {out[-500:]}"
            )

    def remaining(self, staged_exists: Callable[[str], bool]) -> list[str]:
        return [n for n in self.containers() or [] if staged_exists(n)]

    def release(self) -> str | None:
        """Abort connections from the old pod address and unlock; returns a warning or None."""
        netns = _read(self._p(NETLOCK_FILE))
        warning = None
        if netns is not None:
            rc, out = self.run(["nsenter", f"--net={netns}", "sh", "-c", unlock_script(self.borrowed())], "")
            if rc != 0:
                warning = f"unlocking the pod's network failed (exit {rc}): {out[-500:]}"
        _write(self._p(RELEASED_FILE), f"{self.clock():.3f}")
        for name in (NETLOCK_FILE, BORROWED_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._p(name))
        return warning
