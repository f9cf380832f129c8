"""The PodSnapshot status contract: written by the node agent, read by the plugin, described by the CRD.

One module for all three, so that they cannot drift:

- the agent builds every status patch with :func:`claimed`, :func:`progress`, :func:`succeeded` and
  :func:`failed` (JSON merge patches of ``status``; arrays such as ``conditions`` are replaced whole);
- the plugin reads a status with :func:`read` into a :class:`SnapshotStatus`;
- ``kubectl_snapshot/deploy/crd.py`` takes the stage enum and the condition types from here.

A failure is recorded as separate fields, never as CLI text: ``reason`` (CamelCase, for machines),
``message`` (what failed and why) and ``hint`` (what to do). ``conditions`` follow metav1.Condition
(type, status, reason, message, lastTransitionTime, observedGeneration), so that
``kubectl wait --for=condition=Succeeded podsnapshot/NAME`` (or ``=Failed``) works.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from kubectl_snapshot.core import kubenames as K


class Stage(StrEnum):
    """Where a snapshot is: written to ``status.stage`` as it moves on."""

    CLAIMED = "claimed"  # an agent took it (phase Running)
    FREEZE = "freeze"  # every container of the pod is being frozen
    DUMP = "dump"  # CRIU dumps the frozen containers
    UPLOAD = "upload"  # packaging and pushing to the registry (the pod runs again unless stop)
    STOP = "stop"  # with spec.stop: the pod is deleted and its frozen containers killed
    DONE = "done"
    FAILED = "failed"


STAGES: Final = tuple(s.value for s in Stage)

# Condition types (metav1.Condition). Both are always present once an agent claimed the object.
COND_SUCCEEDED: Final = "Succeeded"  # Unknown while running, True when pushed, False when failed
COND_FAILED: Final = "Failed"  # False while running or when pushed, True when failed
CONDITION_TYPES: Final = (COND_SUCCEEDED, COND_FAILED)

REASON_RUNNING: Final = "Running"
REASON_PUSHED: Final = "Pushed"
REASON_FAILED: Final = "Failed"  # when the error has no more specific reason


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (what `kubectl get podsnapshots` shows in its SIZE column)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def condition(
    type_: str, status: str, reason: str, message: str, *, now: str, generation: int | None
) -> dict[str, Any]:
    """One metav1.Condition."""
    c: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message[:1000],
        "lastTransitionTime": now,
    }
    if generation is not None:
        c["observedGeneration"] = generation
    return c


def _conditions(succeeded: str, reason: str, message: str, *, now: str, generation: int | None) -> list[Any]:
    failed = {"True": "False", "False": "True", "Unknown": "False"}[succeeded]
    return [
        condition(COND_SUCCEEDED, succeeded, reason, message, now=now, generation=generation),
        condition(COND_FAILED, failed, reason, message, now=now, generation=generation),
    ]


def claimed(*, node: str, now: str, generation: int | None) -> dict[str, Any]:
    """The claim: written with the object's resourceVersion so that exactly one agent wins."""
    return {
        "phase": K.PHASE_RUNNING,
        "node": node,
        "stage": Stage.CLAIMED.value,
        "startTime": now,
        "observedGeneration": generation,
        "conditions": _conditions(
            "Unknown", REASON_RUNNING, f"taken by the agent on node {node}", now=now, generation=generation
        ),
    }


def progress(*, stage: str | None = None, done: int | None = None, total: int | None = None) -> dict[str, Any]:
    """A progress update (at most about once a second: the API server is not a progress bar)."""
    patch: dict[str, Any] = {}
    if stage is not None:
        patch["stage"] = Stage(stage).value  # a stage outside the contract is a bug, not a status
    if done is not None:
        patch["bytesDone"] = done
    if total is not None:
        patch["bytesTotal"] = total
    return patch


@dataclass(frozen=True)
class Outcome:
    """What a successful snapshot reports."""

    reference: str
    tag: str
    size: int
    frozen_by: str
    timings_ms: Mapping[str, float]


# preflight: the checks before the freeze; stop (a save with stop, a final save): the push verified, the
# pod deleted, its containers killed and gone
TIMING_KEYS: Final = ("preflightMs", "freezeMs", "dumpMs", "packageMs", "uploadMs", "stopMs", "totalMs")


def succeeded(o: Outcome, *, node: str, now: str, generation: int | None) -> dict[str, Any]:
    message = f"pushed {o.reference}"
    t = o.timings_ms
    return {
        "phase": K.PHASE_SUCCEEDED,
        "node": node,
        "stage": Stage.DONE.value,
        "bytesDone": o.size,
        "bytesTotal": o.size,
        "timings": {k: round(float(t.get(_snake(k), 0)), 1) for k in TIMING_KEYS if k != "stopMs" or "stop_ms" in t},
        "frozenBy": o.frozen_by,
        "reference": o.reference,
        "tag": o.tag,
        "size": o.size,
        "sizeHuman": human_bytes(o.size),
        "reason": REASON_PUSHED,
        "message": message,
        "hint": None,
        "completionTime": now,
        "observedGeneration": generation,
        "conditions": _conditions("True", REASON_PUSHED, message, now=now, generation=generation),
    }


def failed(
    *,
    node: str,
    now: str,
    generation: int | None,
    reason: str,
    message: str,
    hint: str | None,
    details: str | None = None,
) -> dict[str, Any]:
    """A terminal failure; ``details`` carries e.g. the tail of CRIU's dump.log."""
    reason = reason or REASON_FAILED
    return {
        "phase": K.PHASE_FAILED,
        "node": node,
        "stage": Stage.FAILED.value,
        "reason": reason,
        "message": message,
        "hint": hint,
        "details": details,
        "completionTime": now,
        "observedGeneration": generation,
        "conditions": _conditions("False", reason, message, now=now, generation=generation),
    }


def _snake(camel: str) -> str:
    """freezeMs -> freeze_ms (the engine's timing names)."""
    return camel[:-2] + "_ms"


# --- reading --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotStatus:
    """What the plugin reads from a PodSnapshot's status while it waits."""

    phase: str
    node: str
    stage: str
    bytes_done: int
    bytes_total: int
    reference: str
    message: str
    hint: str | None = None
    reason: str = ""
    details: str = ""

    @property
    def claimed(self) -> bool:
        return bool(self.phase)

    @property
    def done(self) -> bool:
        return self.phase in K.TERMINAL_PHASES


def read(obj: Mapping[str, Any]) -> SnapshotStatus:
    """Parse a PodSnapshot's status, tolerating missing and mistyped fields."""
    st = obj.get("status") or {}

    def num(key: str) -> int:
        v = st.get(key)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0

    message = str(st.get("message") or "")
    hint = st.get("hint")
    if not isinstance(hint, str) or not hint:
        # Agents before the status contract wrote CLI text ("error: ... hint: ...") into message.
        message, hint = _legacy_split(message)
    return SnapshotStatus(
        phase=str(st.get("phase") or ""),
        node=str(st.get("node") or ""),
        stage=str(st.get("stage") or ""),
        bytes_done=num("bytesDone"),
        bytes_total=num("bytesTotal"),
        reference=str(st.get("reference") or ""),
        message=message,
        hint=hint,
        reason=str(st.get("reason") or ""),
        details=str(st.get("details") or ""),
    )


def _legacy_split(text: str) -> tuple[str, str | None]:
    text = text.strip()
    if text.startswith("error: "):
        text = text[len("error: ") :]
    for sep in ("\nhint: ", " hint: "):
        if sep in text:
            message, hint = text.split(sep, 1)
            return message.strip(), hint.strip()
    return text, None
