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
    until the last one is, every packet in the namespace is dropped (an nf_tables table of its own,
    which CRIU's per-connection lock cannot undo); TCP retransmits whatever was dropped once it is
    released;
``.released``
    written when the lock was released (all containers restored);
``.failed``
    the reason, once any container of the pod could not be restored. From then on the wrapper
    refuses to create every snapshotted container of the pod, so none of them starts from scratch;
    the agent reports the failure and stops the containers already restored. Only for a restore a
    user asked for (``restore-from``): a refusal they must see;
``.fresh``
    the reason, once a container of a *resuming* pod (a workload's replacement, resumed by its policy)
    could not be restored: a resume never holds a workload down, so the pod starts fresh instead. The
    wrapper creates this and every later container from its image, and the agent stops the ones
    already restored (listed in ``.restored``), which the kubelet then creates again, fresh, and
    reports why (a ``ResumeSkipped`` Event);
``.restored``
    the names of the containers restored so far, one a line.

Connections that leave the pod cannot follow it to another node: their local address was the old pod
IP. CRIU binds them back and reconnects them in repair mode, and the kernel's route lookup for that
``connect`` refuses a source address that is not local ("Network is unreachable"), so before each
container is restored the wrapper lends the namespace the old addresses its sockets were bound to
(``ip addr add ADDR dev lo``, only those not already local, listed in ``.borrowed``) while the lock
is held. Before the lock is released the wrapper aborts every such connection (``ss -K``, an abort as
if a reset had come) and takes the borrowed addresses away again: the application sees
ECONNABORTED/ECONNRESET at once and reconnects.

All of it runs in the hook's own process, from a thread that joined the pod's network namespace
(shim/net/netns.py): the lock through nf_tables (shim/net/nftlock.py), the addresses through rtnetlink
(shim/net/ifaddr.py), the aborts through sock_diag (shim/net/tcpabort.py), ``ip_nonlocal_bind`` as a file.
No tool of the host (``nsenter``, ``sh``, ``iptables-restore``, ``ip``, ``ss``) is run, so nodes
without any (Talos, Bottlerocket) restore pods the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

CONTAINERS_FILE = ".containers.json"
NETLOCK_FILE = ".netlock"
RELEASED_FILE = ".released"
FAILED_FILE = ".failed"
FRESH_FILE = ".fresh"
RESTORED_FILE = ".restored"
BORROWED_FILE = ".borrowed"
MUTEX_FILE = ".lock"
# A snapshotted container created again without staged data this soon after the pod's restore ended
# is a restored process that died at once: refused (the pod failed), not started from its image.
GRACE_S = 120.0

LOCK_TABLE = "kubectl-snapshot-pod-lock"  # nf_tables table, family inet (shim/net/nftlock.py)
NONLOCAL_BIND = ("/proc/sys/net/ipv4/ip_nonlocal_bind", "/proc/sys/net/ipv6/ip_nonlocal_bind")


class PodNetwork(Protocol):
    """What a whole-pod restore does to the pod's network namespace (its path)."""

    def lock(self, netns_path: str) -> None:
        """Drop every packet; allow binds to addresses that are not (yet) local."""

    def borrow(self, netns_path: str, addresses: list[str], added: list[str]) -> None:
        """Make each address local (on lo) unless it is; appends what it added ("ADDR/32") to `added`."""

    def release(self, netns_path: str, borrowed: list[str]) -> list[str]:
        """Abort connections from non-loopback addresses, remove `borrowed`, unlock; returns problems."""


def with_prefix(address: str) -> str:
    return f"{address}/128" if ":" in address else f"{address}/32"


def _set_nonlocal_bind(value: str) -> None:
    for i, path in enumerate(NONLOCAL_BIND):
        if i and not os.path.exists(path):
            continue  # IPv6 disabled in the namespace: nothing to allow there
        with open(path, "w") as f:  # this thread's namespace: /proc/sys/net follows the opener
            f.write(value)


class KernelPodNetwork:
    """The real thing, in-process: a thread in the pod's namespace talks netlink (shim/net/netns.py).

    Imported when used: the hook's pass-through calls (runc state, kill, ...) never load them."""

    def lock(self, netns_path: str) -> None:
        from shim.net import netns, nftlock

        def work() -> None:
            nftlock.lock(LOCK_TABLE)
            try:
                _set_nonlocal_bind("1")
            except OSError:
                nftlock.unlock(LOCK_TABLE)  # not recorded as locked: nobody would lift it later
                raise

        netns.run_in(netns_path, work)

    def borrow(self, netns_path: str, addresses: list[str], added: list[str]) -> None:
        import ipaddress

        from shim.net import ifaddr, netns

        def work() -> None:
            local = ifaddr.local_addresses()
            for a in addresses:
                if str(ipaddress.ip_address(a)) not in local and ifaddr.add_address(with_prefix(a), "lo"):
                    added.append(with_prefix(a))

        netns.run_in(netns_path, work)

    def release(self, netns_path: str, borrowed: list[str]) -> list[str]:
        from shim.net import ifaddr, netns, nftlock, tcpabort

        def work() -> list[str]:
            problems = []
            try:  # while still locked: the aborts' resets go nowhere, the applications see them at once
                tcpabort.abort_external()
            except OSError as e:
                problems.append(f"aborting connections from the old pod address failed: {e}")
            for cidr in borrowed:
                try:
                    ifaddr.del_address(cidr, "lo")
                except OSError as e:
                    problems.append(f"removing the borrowed address {cidr} failed: {e}")
            try:
                _set_nonlocal_bind("0")
            except OSError as e:
                problems.append(f"resetting ip_nonlocal_bind failed: {e}")
            try:
                nftlock.unlock(LOCK_TABLE)
            except OSError as e:
                problems.append(f"unlocking the pod's network failed: {e}")
            return problems

        return netns.run_in(netns_path, work)


KERNEL = KernelPodNetwork()


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
    net: PodNetwork = KERNEL
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

    def fresh(self) -> str | None:
        """Why the resuming pod starts fresh (None: it does not)."""
        return _read(self._p(FRESH_FILE))

    def start_fresh(self, reason: str) -> None:
        if self.fresh() is None and os.path.isdir(self.directory):
            _write(self._p(FRESH_FILE), reason.strip() + "\n")

    def restored(self) -> list[str]:
        text = _read(self._p(RESTORED_FILE)) or ""
        return [line for line in text.splitlines() if line]

    def mark_restored(self, name: str) -> None:
        _write(self._p(RESTORED_FILE), "".join(f"{n}\n" for n in [*self.restored(), name]))

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
        if self.fresh() is not None:
            return None  # a resume that could not be restored: every container starts from its image
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
        try:
            self.net.lock(netns)
        except OSError as e:
            raise OSError(
                f"locking the pod's network failed: {e} (the node's kernel needs nf_tables: "
                "CONFIG_NF_TABLES, CONFIG_NF_TABLES_INET; `kubectl snapshot doctor` checks it)"
            ) from None
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
        added: list[str] = []
        try:
            self.net.borrow(netns, addresses, added)
        except OSError as e:
            raise OSError(
                f"adding the old pod addresses {', '.join(addresses)} to the pod's network failed: {e}"
            ) from None
        finally:
            if added:
                _write(self._p(BORROWED_FILE), json.dumps(sorted(set(self.borrowed()) | set(added))))

    def remaining(self, staged_exists: Callable[[str], bool]) -> list[str]:
        return [n for n in self.containers() or [] if staged_exists(n)]

    def release(self) -> str | None:
        """Abort connections from the old pod address and unlock; returns a warning or None."""
        netns = _read(self._p(NETLOCK_FILE))
        warning = None
        if netns is not None:
            try:
                problems = self.net.release(netns, self.borrowed())
            except OSError as e:  # the namespace is gone (the pod with it), say
                problems = [f"releasing the pod's network failed: {e}"]
            warning = "; ".join(problems) or None
        _write(self._p(RELEASED_FILE), f"{self.clock():.3f}")
        for name in (NETLOCK_FILE, BORROWED_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._p(name))
        return warning
