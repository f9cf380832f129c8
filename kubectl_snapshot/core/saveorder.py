"""The order a node's agent runs its saves in, when several run at once (issue 43; pure decisions).

A node that gets a preemption notice (30 s on GCP and Azure spot, 2 minutes on AWS) must push the
final save of every protected pod before its preStop hook ends. The agent's save queue
(shim/controller/workqueue.py) runs several saves at once and asks ``pick`` which waiting save goes
next:

- urgent saves (the final save of a pod being terminated) before the others, then user saves, then
  periodic ones (autosave);
- among those, the earliest deadline first (a final save's ``thaw_by``: the end of its preStop hook);
- then the least to send (the size of the pod's last save: small pods finish and leave the queue);
- then the namespace that had the fewest turns (issue 10: one namespace's hundred saves delay
  another's by one), then first come first served;
- one save per pod at a time: a pod whose save runs waits, whatever its rank;
- ``reserve`` workers are kept for urgent saves: periodic and user saves never take every worker, so a
  final save never waits behind a long periodic upload.

A second periodic save of a pod whose periodic save still waits is the same work: ``superseded``
names the waiting one, which the queue drops (its save is taken by the newer request). An urgent save
supersedes every waiting non-urgent save of its pod (the final save sends what they would have).

``too_late`` says when a waiting urgent save can no longer finish before its deadline: it is not
started (the pod is not frozen for nothing) and the last good save stands for its replacement.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from kubectl_snapshot.core.errors import InvalidArgument

URGENT: Final = 0  # the final save of a pod being terminated
USER: Final = 1  # a PodSnapshot a user (or migrate) created
PERIODIC: Final = 2  # a SnapshotPolicy's scheduled save
MIN_WORKERS: Final = 2  # the default save concurrency never goes below this (one is kept for urgent saves)
URGENT_RESERVE: Final = 1  # workers kept free of non-urgent saves
MIN_SAVE_S: Final = 2.0  # a final save is not started with less than this left before its thaw_by


@dataclass(frozen=True)
class SaveRequest:
    """One save waiting for (or holding) a worker of the node's save queue."""

    pod: str  # the pod's uid: one save per pod at a time ("" : no such rule, e.g. a job of no pod)
    kind: int = USER  # URGENT | USER | PERIODIC
    deadline: float | None = None  # thaw_by, on the queue's clock: the save must end (and thaw) by then
    estimate: int = 0  # bytes it is expected to send (its pod's last save; 0: unknown)
    key: str = ""  # the namespace (turns across namespaces)
    seq: int = 0  # arrival order, set by the queue

    @property
    def urgent(self) -> bool:
        return self.kind == URGENT


def rank(req: SaveRequest, turns: Mapping[str, int]) -> tuple[int, float, int, int, int]:
    """Smaller goes first: urgency, deadline, bytes to send, the namespace's turns so far, arrival."""
    deadline = req.deadline if req.deadline is not None else math.inf
    return (req.kind, deadline, req.estimate, turns.get(req.key, 0), req.seq)


def pick(
    waiting: Iterable[SaveRequest],
    running: Collection[SaveRequest],
    *,
    workers: int,
    reserve: int = URGENT_RESERVE,
    turns: Mapping[str, int] | None = None,
) -> SaveRequest | None:
    """The waiting save to start now on a free worker, or None (no worker free, or none may start)."""
    if len(running) >= workers:
        return None
    busy = {r.pod for r in running if r.pod}
    # the workers non-urgent saves may hold: all but the reserve (at least one, or nothing periodic runs)
    ordinary_cap = max(1, workers - reserve)
    ordinary_running = sum(1 for r in running if not r.urgent)
    ready = [w for w in waiting if (not w.pod or w.pod not in busy) and (w.urgent or ordinary_running < ordinary_cap)]
    if not ready:
        return None
    return min(ready, key=lambda w: rank(w, turns or {}))


def superseded(waiting: Iterable[SaveRequest], new: SaveRequest) -> list[SaveRequest]:
    """The waiting saves of `new`'s pod that `new` makes pointless: every non-urgent one when `new` is
    urgent, the periodic ones when `new` is periodic. User saves are kept (someone asked for each)."""
    if not new.pod:
        return []
    same = [w for w in waiting if w.pod == new.pod and w.seq != new.seq]
    if new.urgent:
        return [w for w in same if not w.urgent]
    if new.kind == PERIODIC:
        return [w for w in same if w.kind == PERIODIC]
    return []


def too_late(req: SaveRequest, now: float, min_save_s: float = MIN_SAVE_S) -> bool:
    """A waiting save whose deadline leaves less than `min_save_s` to freeze, dump and push."""
    return req.deadline is not None and req.deadline - now < min_save_s


def too_late_reason(waited_s: float, left_s: float) -> str:
    """Why a save with a deadline was never started: its deadline came while it waited."""
    return (
        f"it waited {waited_s:.0f}s for a worker of the node's save queue and only {max(left_s, 0):.1f}s were"
        " left before its thaw_by deadline (the end of the pod's preStop hook), so the pod was never frozen"
    )


def thawed_message(name: str, left_s: float) -> str:
    """The failure of a final save thawed at its thaw_by deadline before its push was verified."""
    return (
        f"final save {name} was thawed at its thaw_by deadline ({left_s:.0f}s before its preStop hook ended)"
        " before its push was verified: the pod ran on and ends as it would have"
    )


def worker_count(setting: str, cpus: int | None, *, what: str, default_min: int = MIN_WORKERS) -> int:
    """Workers from a ``--save-concurrency``/``--dump-concurrency`` value: a positive integer, or empty
    for the default (one per CPU, at least `default_min`)."""
    value = setting.strip()
    if not value:
        return max(default_min, cpus or 1)
    if not value.isdigit() or int(value) < 1:
        raise InvalidArgument(
            f"{what} must be a positive whole number, got {setting!r}",
            hint="leave it empty for the default (one per CPU, at least 2 for saves; 1 for dumps)",
        )
    return int(value)


def urgent_reserve(workers: int) -> int:
    """Workers kept for urgent saves: one wherever there are two or more (a single worker is shared)."""
    return URGENT_RESERVE if workers >= MIN_WORKERS else 0
