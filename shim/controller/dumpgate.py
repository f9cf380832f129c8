"""How many of the node's saves freeze and dump at once (``--dump-concurrency``, default 1; issue 43).

Several saves run at once (shim/controller/workqueue.py), but a freeze must stay short: CRIU dumps
compete for the same CPUs and memory bandwidth, so two overlapping dumps make both pods' freezes
longer. The gate holds a slot from a save's ``freeze`` phase to the end of its dump (the engine's
``upload`` or ``stop`` phase, or the end of the save), so that one pod is frozen and dumped while the
others compress, seal and upload theirs. Waiting saves get a free slot in the order of
core/saveorder.py (a final save before a periodic one). A save with a deadline that is too close when
its slot comes is refused before anything is frozen.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from kubectl_snapshot.core import saveorder as O
from kubectl_snapshot.core.errors import FailedPrecondition

PhaseFn = Callable[[str], None]
HOLD_FROM = "freeze"
RELEASE_AT = frozenset({"upload", "stop"})


class DumpGate:
    def __init__(self, slots: int, *, clock: Callable[[], float] = time.time) -> None:
        if slots < 1:
            raise ValueError("the dump gate needs at least one slot")
        self.slots = slots
        self.clock = clock
        self._held = 0
        self._waiting: list[O.SaveRequest] = []
        self._seq = 0
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        with self._cond:
            return self._held

    def acquire(self, req: O.SaveRequest) -> None:
        """Wait for a slot; the waiting save that ranks first gets each slot that frees up."""
        with self._cond:
            self._seq += 1
            mine = O.SaveRequest(req.pod, req.kind, req.deadline, req.estimate, req.key, self._seq)
            self._waiting.append(mine)
            try:
                while self._held >= self.slots or min(self._waiting, key=lambda w: O.rank(w, {})) is not mine:
                    self._cond.wait()
            finally:
                self._waiting.remove(mine)
            self._held += 1

    def release(self) -> None:
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def phases(self, req: O.SaveRequest, on_phase: PhaseFn, *, name: str = "") -> Iterator[PhaseFn]:
        """An ``on_phase`` for the engine that holds a slot from the freeze to the end of the dump."""
        held = False

        def phase(p: str) -> None:
            nonlocal held
            if p == HOLD_FROM and not held:
                t = self.clock()
                self.acquire(req)
                held = True
                if O.too_late(req, self.clock()):
                    left = (req.deadline or 0.0) - self.clock()
                    raise FailedPrecondition(
                        f"save {name} was not frozen: {O.too_late_reason(self.clock() - t, left)}",
                        hint="the pod's last good save stands for its replacement; raise terminationGracePeriodSeconds"
                        " or --dump-concurrency to save more pods within a node's notice",
                    )
            elif p in RELEASE_AT and held:
                self.release()
                held = False
            on_phase(p)

        try:
            yield phase
        finally:
            if held:
                self.release()
