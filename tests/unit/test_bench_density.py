"""bench/density_report.py: the maths behind bench/density.py's on-time verdicts and resource ratios."""

from __future__ import annotations

import pytest

from bench import density_report as R

MIB = 1 << 20


def test_a_pod_saved_every_interval_plus_a_little_is_on_time() -> None:
    # anchor before the span, then a save every 62 s; the open gap at the end is short
    times = [95.0, 157.0, 219.0, 281.0, 343.0]
    p = R.pod_saves("p-0", times, start=100, end=350, interval=60)
    assert p.saves == 4
    assert p.gaps == (62.0, 62.0, 62.0, 62.0)
    assert p.on_time == 4 and not p.starved
    assert p.worst_gap == 62.0


def test_a_gap_beyond_the_slack_is_late_and_two_intervals_starve_the_pod() -> None:
    p = R.pod_saves("p-0", [100.0, 167.0, 300.0], start=100, end=320, interval=60, slack=0.1)
    assert p.gaps == (67.0, 133.0)  # 67 > 66: late; 133 >= 120: a window with no save
    assert p.on_time == 0
    assert p.missed_windows == 1 and p.starved
    assert p.worst_gap == 133.0


def test_the_open_gap_counts_only_once_it_is_late() -> None:
    short = R.pod_saves("p-0", [100.0, 160.0], start=100, end=200, interval=60)
    assert short.gaps == (60.0,) and short.on_time == 1  # 40 s since the last save: not judged yet
    long = R.pod_saves("p-0", [100.0, 160.0], start=100, end=300, interval=60)
    assert long.gaps == (60.0, 140.0)  # the pod has had no save for 140 s at the end
    assert long.on_time == 1 and long.missed_windows == 1 and long.worst_gap == 140.0


def test_a_pod_never_saved_in_the_span_misses_every_window() -> None:
    p = R.pod_saves("p-0", [], start=0, end=600, interval=60)
    assert p.saves == 0 and p.missed_windows == 10 and p.starved and p.on_time == 0


def test_summary_share_worst_gaps_big_and_small_and_the_goal() -> None:
    ok = R.pod_saves("dense-1", [0.0, 61.0, 122.0], start=0, end=150, interval=60)
    big = R.pod_saves("dense-0", [0.0, 70.0, 131.0], start=0, end=150, interval=60, big=True)
    s = R.saves_summary([big, ok], interval=60, span=150, slack=R.DEFAULT_SLACK)
    assert (s["gaps"], s["gaps_on_time"], s["late_gaps"]) == (4, 3, 1)
    assert s["on_time_share"] == 0.75
    assert s["worst_gap_vs_interval"] == pytest.approx(70 / 60, abs=1e-3)
    assert s["worst_gap_vs_interval_big"] == pytest.approx(70 / 60, abs=1e-3)
    assert s["worst_gap_vs_interval_small"] == pytest.approx(61 / 60, abs=1e-3)
    assert s["starved_pods"] == [] and not s["goal_met"]
    assert s["windows_per_pod"] == 2.5
    met = R.saves_summary([ok], interval=60, span=150, slack=0.1)
    assert met["goal_met"] and met["on_time_share"] == 1.0


def test_no_gaps_is_not_a_met_goal() -> None:
    s = R.saves_summary([R.pod_saves("p", [10.0], start=0, end=50, interval=60)], interval=60, span=50, slack=0.1)
    assert s["gaps"] == 0 and s["on_time_share"] is None and not s["goal_met"]


def test_quantities() -> None:
    assert R.cpu_quantity("100m") == pytest.approx(0.1)
    assert R.cpu_quantity("2") == 2.0
    assert R.cpu_quantity(None) is None
    assert R.memory_quantity("128Mi") == 128 * MIB
    assert R.memory_quantity("1G") == 10**9
    assert R.memory_quantity("1048576") == MIB
    assert R.memory_quantity(None) is None


def test_cpu_windows_and_percentile() -> None:
    samples = [(0.0, 0.0), (5.0, 0.5), (10.0, 1.5), (15.0, 1.0), (20.0, 1.5)]  # the counter went back once
    assert R.cpu_windows(samples) == [pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.1)]
    assert R.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert R.percentile([1.0, 2.0], 95) == pytest.approx(1.95)
    assert R.percentile([], 95) is None


def test_resources_against_requests_and_an_undeclared_limit() -> None:
    cpu = [(0.0, 0.0), (5.0, 1.0), (10.0, 1.5)]  # 0.2 then 0.1 cores
    r = R.resources_summary(
        cpu, [100 * MIB, 200 * MIB], kernel_peak=300 * MIB, resources={"requests": {"cpu": "100m", "memory": "128Mi"}}
    )
    assert r["cpu_cores_mean"] == pytest.approx(0.15)
    assert r["cpu_mean_vs_request"] == pytest.approx(1.5)
    assert r["cpu_p95_vs_request"] == pytest.approx(1.95)
    assert r["cpu_p95_vs_limit"] is None and r["memory_max_vs_limit"] is None
    assert r["memory_max_vs_request"] == pytest.approx(200 / 128, abs=1e-3)
    assert r["memory_peak_vs_request"] == pytest.approx(300 / 128, abs=1e-3)
    limited = R.resources_summary(cpu, [64 * MIB], kernel_peak=None, resources={"limits": {"memory": "256Mi"}})
    assert limited["memory_max_vs_limit"] == 0.25 and limited["memory_max_vs_request"] is None


def test_working_set_and_flat_keyed_files() -> None:
    stat = R.parse_flat_keyed("cache 10\ntotal_inactive_file 300\nrss 5\nbad line here\n")
    assert stat == {"cache": 10, "total_inactive_file": 300, "rss": 5}
    assert R.working_set(1000, stat) == 700
    assert R.working_set(1000, {"inactive_file": 200}) == 800
    assert R.working_set(100, {"inactive_file": 200}) == 0


def test_queue_summary() -> None:
    saves: list[dict[str, float | None]] = [
        {"created": 0.0, "started": 1.0, "completed": 3.0},
        {"created": 60.0, "started": 63.0, "completed": 66.0},
        {"created": 120.0, "started": None, "completed": 130.0},
    ]
    q = R.queue_summary(saves, 60)
    assert q["saves"] == 3
    assert q["wait_median_vs_interval"] == pytest.approx(2 / 60, abs=1e-3)
    assert q["total_p95_vs_interval"] == pytest.approx(9.6 / 60, abs=1e-3)


def test_report_prints_ratios_and_the_verdict() -> None:
    ok = R.pod_saves("dense-1", [0.0, 61.0, 122.0], start=0, end=150, interval=60)
    result = {
        "node": "ks-n1", "pods": 1, "mib": 4, "big": 0, "big_mib": 128, "sample_s": 5.0, "failed_saves": 0,
        "saves": R.saves_summary([ok], interval=60, span=150, slack=0.1),
        "queue": R.queue_summary([{"created": 0.0, "started": 1.0, "completed": 2.0}], 60),
        "agent": R.resources_summary(
            [(0.0, 0.0), (5.0, 1.0)], [64 * MIB], kernel_peak=None,
            resources={"requests": {"cpu": "100m", "memory": "128Mi"}},
        ),
    }  # fmt: skip
    text = R.report(result)
    assert "2/2 = 100.00 %" in text and "goal 100 %: met" in text
    assert "mean 2.00x" in text and "no CPU limit declared" in text and "0.50x" in text
