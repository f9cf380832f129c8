"""One network lock around the dumps of a pod's containers: the images of both ends of a connection
between two containers agree.

The agent freezes every container of a snapshot and then has CRIU dump them one after the other.
Frozen processes do not run, but their sockets do: CRIU locks a connection only while it dumps the
task that holds it and unlocks it afterwards (``--leave-running``). So between the dump of a server
container and that of its client, the client's kernel can still send what it held back (Nagle,
waiting for the server's delayed ACK, which the server's repair-off window probe then brings), the
server's kernel acknowledges it, and the client's image no longer holds bytes that the server's image
never received: after the restore the connection stalls for good (the client's "restored client
sends nothing", seen now and then in tests/integration/test_whole_pod_restore.py).

So while the containers are dumped, every packet in the pod's network namespace is dropped, the same
way as during a whole-pod restore (shim/net/podrestore.py, its own table): TCP retransmits whatever was
held back once the lock is gone, or, after a restore, from the images. Only namespaces that two or
more of the snapshot's containers share are locked, never the host's or the agent's own. The lock is
an nf_tables table set through netlink by a thread of the agent that joined the namespace
(shim/net/nftlock.py, shim/net/netns.py): no tool of the host or of the agent image runs. If the agent dies
during the dumps, the freeze guard thaws the pod and the lock stays until the agent's next start
lifts it (release_leftover, with the containers recover_interrupted thaws).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

from kubectl_snapshot.core.errors import FailedPrecondition
from shim.host.facts import host_pid
from shim.net import netns, nftlock

LOCK_TABLE = "kubectl-snapshot-dump-lock"  # nf_tables table, family inet


class NetLock(Protocol):
    """Locks a network namespace (its path, /proc/PID/ns/net)."""

    def lock(self, netns_path: str) -> None: ...

    def unlock(self, netns_path: str) -> bool: ...  # False: there was no lock


class KernelLock:
    """The real lock: the nf_tables table in the namespace, from a thread that joined it."""

    def lock(self, netns_path: str) -> None:
        netns.run_in(netns_path, lambda: nftlock.lock(LOCK_TABLE))

    def unlock(self, netns_path: str) -> bool:
        return netns.run_in(netns_path, lambda: nftlock.unlock(LOCK_TABLE))


KERNEL = KernelLock()


def _netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def shared_namespaces(pids: Sequence[int], exclude: Sequence[str | None]) -> dict[str, int]:
    """{netns: a pid in it} for namespaces that two or more of `pids` share, minus `exclude`."""
    seen: dict[str, list[int]] = {}
    for pid in pids:
        ns = _netns(pid)
        if ns is not None and ns not in exclude:
            seen.setdefault(ns, []).append(pid)
    return {ns: members[0] for ns, members in seen.items() if len(members) > 1}


def _targets(pids: Sequence[int]) -> list[str]:
    host = host_pid()
    return [f"/proc/{pid}/ns/net" for pid in shared_namespaces(pids, [_netns("self"), _netns(host or 1)]).values()]


def release_leftover(pids: Sequence[int], net: NetLock = KERNEL) -> int:
    """Lift a lock that a killed agent left (its next start, with the containers it thaws); returns
    how many namespaces had one. Namespaces without the table are left as they are."""
    released = 0
    for path in _targets(pids):
        with contextlib.suppress(OSError):
            released += net.unlock(path)
    return released


@contextlib.contextmanager
def pod_network_locked(pids: Sequence[int], net: NetLock = KERNEL) -> Iterator[None]:
    """Drop every packet in the namespaces the containers (init pids) share, for the block's length.

    Each namespace is held open for the block: a dump that ends its tasks (no --leave-running) takes
    their /proc/PID/ns/net with them, and the lock must still be lifted."""
    held: list[int] = []
    locked: list[str] = []
    try:
        for path in _targets(pids):
            try:
                held.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                net.lock(f"/proc/self/fd/{held[-1]}")
            except OSError as e:
                raise FailedPrecondition(
                    f"locking the pod's network for the dump failed: {e}",
                    hint="the node's kernel needs nf_tables (CONFIG_NF_TABLES, CONFIG_NF_TABLES_INET); "
                    "`kubectl snapshot doctor` checks it",
                ) from None
            locked.append(f"/proc/self/fd/{held[-1]}")
        yield
    finally:
        for path in locked:
            with contextlib.suppress(OSError):
                net.unlock(path)  # best effort: the namespace goes with the pod anyway
        for fd in held:
            os.close(fd)
