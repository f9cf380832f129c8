"""The freeze's expected length, its deadline and the liveness preflight (kubectl_snapshot/core/freeze.py)."""

from __future__ import annotations

import pytest

from kubectl_snapshot.core import freeze as F
from kubectl_snapshot.core.errors import FailedPrecondition

GIB = 1024 * F.MIB


def test_expected_freeze_grows_with_memory_and_with_stop() -> None:
    assert F.expected_freeze_s(0) == F.FIXED_S
    assert F.expected_freeze_s(GIB) == pytest.approx(F.FIXED_S + 16.0)  # 1 GiB at 64 MiB/s
    assert F.expected_freeze_s(GIB, stop=True) == pytest.approx(F.FIXED_S + 16.0 + 32.0)
    assert F.expected_freeze_s(-5) == F.FIXED_S


def test_deadline_is_twice_the_expectation_with_a_floor_and_a_cap() -> None:
    assert F.plan(0).deadline_s == F.MIN_DEADLINE_S
    assert F.plan(GIB).deadline_s == pytest.approx(2 * (F.FIXED_S + 16.0))
    assert F.plan(1024 * GIB).deadline_s == F.MAX_DEADLINE_S
    assert F.plan(GIB).expected_s == pytest.approx(F.FIXED_S + 16.0)


def test_probe_budget_counts_from_a_probe_right_after_the_freeze() -> None:
    assert F.probe_budget_s({}) == (3 - 1) * 10 + 1  # the kubelet's defaults
    assert F.probe_budget_s({"periodSeconds": 5, "failureThreshold": 1, "timeoutSeconds": 2}) == 2
    assert F.probe_budget_s({"periodSeconds": 2, "failureThreshold": 4, "timeoutSeconds": 1}) == 7
    # nonsense values fall back to the defaults rather than to a zero budget
    assert F.probe_budget_s({"periodSeconds": 0, "failureThreshold": "x", "timeoutSeconds": -1}) == 21


def _pod(*containers: dict, statuses: list | None = None) -> dict:  # type: ignore[type-arg]
    return {"spec": {"containers": list(containers)}, "status": {"containerStatuses": statuses or []}}


def test_budgets_of_liveness_probes_and_of_startup_probes_not_passed_yet() -> None:
    pod = _pod(
        {"name": "a", "livenessProbe": {"periodSeconds": 5, "failureThreshold": 3}},
        {"name": "b"},
        {"name": "c", "startupProbe": {"periodSeconds": 1, "failureThreshold": 2}},
        {"name": "d", "startupProbe": {"periodSeconds": 1, "failureThreshold": 2}},
        statuses=[{"name": "c", "started": False}, {"name": "d", "started": True}],
    )
    assert F.probe_budgets(pod) == [F.ProbeBudget("a", "liveness", 11.0), F.ProbeBudget("c", "startup", 2.0)]
    assert F.probe_budgets({}) == []


def test_plan_refuses_a_freeze_that_outlasts_a_liveness_budget() -> None:
    budgets = [F.ProbeBudget("web", "liveness", 11.0), F.ProbeBudget("side", "liveness", 60.0)]
    with pytest.raises(FailedPrecondition) as e:
        F.plan(GIB, budgets=budgets)  # 21 s expected > 11 s
    assert "'web'" in e.value.message and "11 s" in e.value.message
    assert e.value.hint is not None and "--ignore-liveness" in e.value.hint


def test_plan_keeps_the_deadline_inside_the_smallest_budget() -> None:
    p = F.plan(0, budgets=[F.ProbeBudget("web", "liveness", 8.0)])  # 5 s expected; 10 s floor
    assert p.deadline_s == 8.0 - F.LIVENESS_MARGIN_S
    assert p.budget == F.ProbeBudget("web", "liveness", 8.0) and not p.ignored_liveness
    roomy = F.plan(0, budgets=[F.ProbeBudget("web", "liveness", 100.0)])
    assert roomy.deadline_s == F.MIN_DEADLINE_S


def test_expected_just_under_the_budget_but_within_the_margin_is_refused() -> None:
    with pytest.raises(FailedPrecondition):
        F.plan(0, budgets=[F.ProbeBudget("web", "liveness", F.FIXED_S + 0.5)])


def test_ignore_liveness_goes_ahead_with_the_memory_deadline() -> None:
    p = F.plan(GIB, budgets=[F.ProbeBudget("web", "liveness", 3.0)], ignore_liveness=True)
    assert p.deadline_s == pytest.approx(2 * (F.FIXED_S + 16.0)) and p.ignored_liveness
