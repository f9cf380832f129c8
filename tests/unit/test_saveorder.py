"""The order of a node's saves (kubectl_snapshot/core/saveorder.py, issue 43): final saves first, earliest
deadline, least to send, namespaces in turn, one save per pod, a worker kept for final saves."""

from __future__ import annotations

import pytest

from kubectl_snapshot.core import saveorder as O
from kubectl_snapshot.core.errors import InvalidArgument

R = O.SaveRequest


def test_urgent_goes_before_user_before_periodic_whatever_the_arrival() -> None:
    waiting = [R("a", O.PERIODIC, seq=1), R("b", O.USER, seq=2), R("c", O.URGENT, deadline=50.0, seq=3)]
    assert O.pick(waiting, [], workers=4) == waiting[2]
    assert O.pick(waiting[:2], [], workers=4) == waiting[1]


def test_among_urgent_saves_the_earliest_deadline_first_then_the_least_to_send() -> None:
    late = R("a", O.URGENT, deadline=30.0, estimate=1, seq=1)
    soon_big = R("b", O.URGENT, deadline=20.0, estimate=10**9, seq=2)
    soon_small = R("c", O.URGENT, deadline=20.0, estimate=10**6, seq=3)
    assert O.pick([late, soon_big, soon_small], [], workers=4) == soon_small
    assert O.pick([late, soon_big], [], workers=4) == soon_big


def test_without_deadlines_the_least_to_send_then_namespace_turns_then_arrival() -> None:
    big = R("a", O.PERIODIC, estimate=500, key="x", seq=1)
    small = R("b", O.PERIODIC, estimate=100, key="x", seq=2)
    assert O.pick([big, small], [], workers=2) == small
    first = R("c", O.PERIODIC, key="busy", seq=3)
    second = R("d", O.PERIODIC, key="quiet", seq=4)
    assert O.pick([first, second], [], workers=2, turns={"busy": 3}) == second
    assert O.pick([first, second], [], workers=2) == first


def test_one_save_per_pod_at_a_time() -> None:
    running = [R("a", O.PERIODIC, seq=1)]
    same_pod = R("a", O.URGENT, deadline=10.0, seq=2)
    other = R("b", O.PERIODIC, seq=3)
    assert O.pick([same_pod, other], running, workers=4) == other
    assert O.pick([same_pod], running, workers=4) is None


def test_a_worker_is_kept_for_urgent_saves() -> None:
    running = [R("a", O.PERIODIC, seq=1), R("b", O.USER, seq=2)]
    periodic = R("c", O.PERIODIC, seq=3)
    urgent = R("d", O.URGENT, deadline=5.0, seq=4)
    assert O.pick([periodic], running, workers=3) is None  # the third worker waits for a final save
    assert O.pick([periodic, urgent], running, workers=3) == urgent
    assert O.pick([urgent], [*running, urgent], workers=3) is None  # every worker busy


def test_a_single_worker_is_shared_and_urgent_saves_may_take_every_worker() -> None:
    assert O.urgent_reserve(1) == 0 and O.urgent_reserve(4) == 1
    assert O.pick([R("a", O.PERIODIC, seq=1)], [], workers=1, reserve=O.urgent_reserve(1)) is not None
    urgent = [R(str(i), O.URGENT, deadline=9.0, seq=i) for i in range(3)]
    assert O.pick(urgent[2:], urgent[:2], workers=3) == urgent[2]


def test_a_newer_save_supersedes_the_waiting_ones_it_makes_pointless() -> None:
    periodic = R("a", O.PERIODIC, seq=1)
    user = R("a", O.USER, seq=2)
    other_pod = R("b", O.PERIODIC, seq=3)
    waiting = [periodic, user, other_pod]
    assert O.superseded(waiting, R("a", O.PERIODIC, seq=4)) == [periodic]
    assert O.superseded(waiting, R("a", O.URGENT, deadline=1.0, seq=5)) == [periodic, user]
    assert O.superseded(waiting, R("a", O.USER, seq=6)) == []  # someone asked for each user save
    assert O.superseded(waiting, R("", O.PERIODIC, seq=7)) == []


def test_a_save_too_close_to_its_deadline_is_not_started() -> None:
    assert O.too_late(R("a", O.URGENT, deadline=100.0), now=99.0)
    assert not O.too_late(R("a", O.URGENT, deadline=100.0), now=90.0)
    assert not O.too_late(R("a", O.PERIODIC), now=1e12)
    assert "thaw_by" in O.too_late_reason(12.0, -1.0) and "0.0s" in O.too_late_reason(12.0, -1.0)


def test_worker_counts() -> None:
    assert O.worker_count("", 8, what="--save-concurrency") == 8
    assert O.worker_count("", 1, what="--save-concurrency") == 2
    assert O.worker_count("", None, what="--dump-concurrency", default_min=1) == 1
    assert O.worker_count("3", 8, what="--save-concurrency") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(InvalidArgument, match="--save-concurrency"):
            O.worker_count(bad, 2, what="--save-concurrency")
