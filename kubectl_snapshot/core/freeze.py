"""How long a snapshot may keep a pod frozen, and whether a liveness probe would restart it meanwhile.

Pure arithmetic (no I/O), unit-tested in tests/unit/test_freeze_plan.py.

- The expected freeze is a fixed cost (CRIU's start, the network lock, the writable layer) plus the
  pod's memory at a deliberately slow dump rate; with ``stop`` the pod also stays frozen during the
  upload. The deadline given to the freeze guard (shim/freeze_guard.py) is twice that, capped: a freeze
  still running then is thawed by the guard and the snapshot fails, whatever the agent is doing.
- A container's liveness budget is the shortest time after which the kubelet can have seen
  ``failureThreshold`` failed probes of a frozen container: the first probe may start right after the
  freeze and fails after ``timeoutSeconds``, the next ``periodSeconds`` apart, so
  ``(failureThreshold - 1) * periodSeconds + timeoutSeconds``. initialDelaySeconds only delays the
  first probe after a container start, which lies before the freeze: it adds nothing. A container
  whose startup probe has not succeeded yet is held to that probe too.
- A snapshot whose expected freeze reaches a budget is refused unless the user asked to go ahead;
  otherwise the deadline is kept one second inside the smallest budget, so the guard thaws before
  the kubelet could count the last failure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core.errors import FailedPrecondition

MIB = 1024 * 1024
FIXED_S = 5.0  # CRIU's start-up, network lock, writable layer, volumes: far above what this takes
DUMP_RATE = 64 * MIB  # bytes/s; CRIU writes pages several times faster on the project's VMs
UPLOAD_RATE = 32 * MIB  # bytes/s, compress + push (only with stop: the pod stays frozen meanwhile)
DEADLINE_FACTOR = 2.0
MIN_DEADLINE_S = 10.0
MAX_DEADLINE_S = 600.0  # the guard also caps what it accepts at this
LIVENESS_MARGIN_S = 1.0

# The kubelet's defaults for a probe (k8s.io/api/core/v1).
PROBE_DEFAULTS = {"periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 1}


@dataclass(frozen=True)
class ProbeBudget:
    container: str
    probe: str  # "liveness" or "startup"
    seconds: float


@dataclass(frozen=True)
class FreezePlan:
    memory_bytes: int
    expected_s: float
    deadline_s: float
    budget: ProbeBudget | None  # the smallest probe budget taken into account (None: no probes)
    ignored_liveness: bool = False


def expected_freeze_s(memory_bytes: int, *, stop: bool = False) -> float:
    seconds = FIXED_S + max(memory_bytes, 0) / DUMP_RATE
    if stop:
        seconds += max(memory_bytes, 0) / UPLOAD_RATE
    return seconds


def probe_budget_s(probe: Mapping[str, Any]) -> float:
    def field(name: str) -> int:
        value = probe.get(name)
        return int(value) if isinstance(value, int) and value > 0 else PROBE_DEFAULTS[name]

    return float((field("failureThreshold") - 1) * field("periodSeconds") + field("timeoutSeconds"))


def probe_budgets(pod: Mapping[str, Any]) -> list[ProbeBudget]:
    """Every app container's liveness budget, and its startup budget while that probe has not passed."""
    started = {
        cs.get("name"): cs.get("started") is not False
        for cs in (pod.get("status") or {}).get("containerStatuses") or []
        if isinstance(cs, Mapping)
    }
    out = []
    for c in (pod.get("spec") or {}).get("containers") or []:
        if not isinstance(c, Mapping):
            continue
        name = str(c.get("name", ""))
        if isinstance(c.get("livenessProbe"), Mapping):
            out.append(ProbeBudget(name, "liveness", probe_budget_s(c["livenessProbe"])))
        if isinstance(c.get("startupProbe"), Mapping) and not started.get(name, True):
            out.append(ProbeBudget(name, "startup", probe_budget_s(c["startupProbe"])))
    return out


def plan(
    memory_bytes: int,
    *,
    stop: bool = False,
    budgets: Iterable[ProbeBudget] = (),
    ignore_liveness: bool = False,
) -> FreezePlan:
    """The freeze's expected length and deadline; raises FailedPrecondition when a probe would fail."""
    expected = expected_freeze_s(memory_bytes, stop=stop)
    deadline = min(MAX_DEADLINE_S, max(MIN_DEADLINE_S, expected * DEADLINE_FACTOR))
    smallest = min(budgets, key=lambda b: b.seconds, default=None)
    if smallest is None or ignore_liveness:
        return FreezePlan(memory_bytes, expected, deadline, smallest, ignored_liveness=smallest is not None)
    if expected + LIVENESS_MARGIN_S >= smallest.seconds:
        raise FailedPrecondition(
            f"the pod would stay frozen for up to {expected:.0f} s ({memory_bytes / MIB:.0f} MiB of memory), "
            f"but the {smallest.probe} probe of container {smallest.container!r} restarts it after "
            f"{smallest.seconds:.0f} s of failed probes (failureThreshold, periodSeconds, timeoutSeconds)",
            hint="raise the probe's failureThreshold or periodSeconds, or snapshot anyway with --ignore-liveness "
            "(spec.ignoreLiveness: true): the container may then be restarted and lose its state",
        )
    return FreezePlan(memory_bytes, expected, min(deadline, smallest.seconds - LIVENESS_MARGIN_S), smallest)
