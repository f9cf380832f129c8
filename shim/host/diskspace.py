"""The node's disk ledger: every dump, volume tar and restore staging reserves its bytes first.

One ledger per agent process (the agent is one process per node; its snapshots, restores and the
standalone commands it serves run on its threads), so writes in flight see each other's promises: two
restores that each fit the free space but not together are not both admitted. The arithmetic and the
refusal are kubectl_snapshot/core/diskspace.py's; this module reads the filesystem and keeps the books.

Reservations are keyed by filesystem (st_dev of the directory written to): a dump in the state dir and
a restore's downloads beside it share one budget. A reservation lasts as long as its write: the bytes
then show in the filesystem's own free space.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

from kubectl_snapshot.core.diskspace import Ask, DiskPolicy, FsState, Held, admit

StatFn = Callable[[str], os.statvfs_result]
DeviceFn = Callable[[str], int]


class Reservation:
    """Bytes promised to one write; `room` is what the write may take at most (its need included)."""

    def __init__(self, ledger: DiskLedger, device: int, ask: Ask, room: int) -> None:
        self._ledger, self.device, self.ask, self.room = ledger, device, ask, room
        self._released = False

    def release(self) -> None:
        """Idempotent: the promise goes once."""
        with self._ledger._lock:
            if not self._released:
                self._released = True
                self._ledger._held.remove(self)


class DiskLedger:
    def __init__(
        self,
        policy: DiskPolicy | None = None,
        *,
        statvfs: StatFn | None = None,
        device_of: DeviceFn | None = None,
    ) -> None:
        self.policy = policy or DiskPolicy()
        # looked up at each call (not bound here): tests replace os.statvfs for the engine's ledger
        self._statvfs = statvfs or (lambda path: os.statvfs(_existing(path)))
        self._device_of = device_of or (lambda path: os.stat(_existing(path)).st_dev)
        self._lock = threading.Lock()
        self._held: list[Reservation] = []

    def configure(self, policy: DiskPolicy) -> None:
        """The node's settings (the agent's start); promises already made stay."""
        with self._lock:
            self.policy = policy

    def take(self, directory: str, ask: Ask) -> Reservation:
        """Reserve `ask.need` bytes on `directory`'s filesystem or raise FailedPrecondition; the caller
        releases it (prefer `reserve`)."""
        device = self._device_of(directory)
        with self._lock:  # the check and the promise at once: no second writer between them
            st = self._statvfs(directory)
            fs = FsState(directory, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)
            mine = [r for r in self._held if r.device == device]
            same_ns = [r for r in mine if r.ask.namespace == ask.namespace and r.ask.kind == ask.kind]
            held = Held(sum(r.ask.need for r in mine), sum(r.ask.need for r in same_ns))
            room = admit(ask, fs, held, self.policy)
            res = Reservation(self, device, ask, room)
            self._held.append(res)
            return res

    @contextlib.contextmanager
    def reserve(self, directory: str, ask: Ask) -> Iterator[Reservation]:
        """`take`, released when the block ends, however it ends."""
        res = self.take(directory, ask)
        try:
            yield res
        finally:
            res.release()

    def held(self) -> dict[tuple[str, str], int]:
        """Bytes promised now, by (kind, namespace): the agent's metrics."""
        out: dict[tuple[str, str], int] = {}
        with self._lock:
            for r in self._held:
                key = (r.ask.kind, r.ask.namespace)
                out[key] = out.get(key, 0) + r.ask.need
        return out


def _existing(path: str) -> str:
    """`path`, or its nearest existing parent (a state dir's work dir is made after the reservation)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


NODE = DiskLedger()  # this process's: the agent configures it from its node settings at start
