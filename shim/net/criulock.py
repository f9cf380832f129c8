"""CRIU's own network lock, lifted when a dump fails and CRIU did not lift it (threat A2).

A CRIU killed in the middle of a dump (``kill -9``, the OOM killer, a crash) leaves its ``inet CRIU-<id>``
table in the container's network namespace: the container is thawed and runs on, but drops every
packet. Around the dumps the agent lists each container namespace's tables (before anything is frozen)
and, if the dumps fail, deletes the tables of CRIU's name that appeared meanwhile
(kubectl_snapshot/core/criulock.py decides which), through netlink from a thread in the namespace
(shim/net/nftlock.py, shim/net/netns.py). Each namespace is held open for the block, as in dumplock.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Protocol

from kubectl_snapshot.core import criulock
from shim.net import netns, nftlock

log = logging.getLogger(__name__)


class Tables(Protocol):
    """The inet tables of a network namespace (its path), and deleting one of them."""

    def names(self, netns_path: str) -> list[str]: ...

    def delete(self, netns_path: str, table: str) -> bool: ...  # False: it was gone already


class KernelTables:
    def names(self, netns_path: str) -> list[str]:
        return netns.run_in(netns_path, nftlock.tables)

    def delete(self, netns_path: str, table: str) -> bool:
        return netns.run_in(netns_path, lambda: nftlock.unlock(table))


KERNEL = KernelTables()


def _open_namespaces(pids: Sequence[int]) -> list[int]:
    """One fd per distinct network namespace of `pids` (a task already gone is skipped)."""
    seen: set[str] = set()
    fds: list[int] = []
    for pid in pids:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
            if ns in seen:
                continue
            fds.append(os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
            seen.add(ns)
        except OSError:
            continue
    return fds


@contextlib.contextmanager
def lifted_after_failure(pids: Sequence[int], tables: Tables = KERNEL) -> Iterator[list[str]]:
    """Around the dumps of the containers whose init pids are `pids`: when the block fails, delete the
    CRIU lock tables that appeared in their namespaces meanwhile. Yields the list of what was lifted
    (``<namespace>: inet <table>``), filled on failure. Never fails the dump for itself: a namespace
    whose tables cannot be listed beforehand is left alone."""
    fds = _open_namespaces(pids)
    lifted: list[str] = []
    try:
        before: dict[str, list[str]] = {}
        for fd in fds:
            path = f"/proc/self/fd/{fd}"
            with contextlib.suppress(OSError):
                before[path] = tables.names(path)
        try:
            yield lifted
        except BaseException:
            for path, names in before.items():
                try:
                    left = criulock.left_by_dump(names, tables.names(path))
                except OSError as e:
                    log.warning("could not list the nf_tables tables CRIU may have left: %s", e)
                    continue
                for table in left:
                    try:
                        if tables.delete(path, table):
                            lifted.append(f"inet {table}")
                            log.warning("lifted the network lock a failed CRIU dump left: inet %s", table)
                    except OSError as e:
                        log.warning("could not lift the network lock inet %s a failed CRIU dump left: %s", table, e)
            raise
    finally:
        for fd in fds:
            os.close(fd)
