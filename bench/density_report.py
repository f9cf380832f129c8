"""bench/density.py's maths, pure: whether each pod's periodic saves came on time, and the agent's CPU and
memory against what its DaemonSet declares. No I/O here (tests/unit/test_bench_density.py checks it).

**On time**, precisely. A pod's periodic saves are judged by their completion times (``status.completionTime``,
1 s resolution) over the measured span [start, end]:

- its *gaps*: between each pair of consecutive Succeeded saves, the later completing inside the span
  (the earlier may have completed before it: the anchor); and the *open gap* from the last save to
  ``end`` (the span's end is not a save, so this gap is only judged when it already exceeds the limit);
- a gap is **on time** when it is at most ``interval * (1 + slack)``: the agent's schedule makes the next
  save due one interval after the last was *created* (kubectl_snapshot/core/autosave.py), looks for due
  saves every second, and a save takes a few seconds to complete, so a pod saved every interval shows
  gaps of a little over one interval; the slack (default 0.1: 6 s at a 1-minute interval) is that
  allowance, stated in the output;
- a pod **missed a window** when a gap (the open one included) is at least two intervals long: a whole
  interval passed with no save of it. A pod with no save completing in the span misses every window;
- a pod is **starved** when it missed a window.

**100 % on time** (the issue's goal) means: every gap of every pod is on time, the open gaps included,
and no pod missed a window.

The agent's CPU is the cores it used per sampling window (cgroup CPU time / wall time), averaged over the
span and at its 95th percentile; its memory the largest sample of the container's working set (usage less
inactive file pages, what the kubelet compares to a limit) and the kernel's own peak where the cgroup
keeps one. Each is printed as a ratio to the DaemonSet's request and limit (a limit it does not declare:
no ratio).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_SLACK = 0.1  # of the interval
STARVED_INTERVALS = 2.0  # a gap this many intervals long leaves a whole window without a save

_MEM_SUFFIX = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}  # fmt: skip


def cpu_quantity(q: str | int | float | None) -> float | None:
    """Cores of a Kubernetes CPU quantity ("100m", "2", "0.5")."""
    if q is None:
        return None
    s = str(q).strip()
    if s.endswith("m"):
        return float(s[:-1]) * 1e-3
    return float(s)


def memory_quantity(q: str | int | float | None) -> int | None:
    """Bytes of a Kubernetes memory quantity ("128Mi", "1G", "1048576")."""
    if q is None:
        return None
    s = str(q).strip()
    for suffix in sorted(_MEM_SUFFIX, key=len, reverse=True):
        if suffix and s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * _MEM_SUFFIX[suffix])
    return int(float(s))


@dataclass(frozen=True)
class PodSaves:
    """One pod's verdict over the span."""

    pod: str
    big: bool
    saves: int  # Succeeded saves completing inside the span
    gaps: tuple[float, ...]  # seconds, closed gaps (the open one, when late, is appended)
    on_time: int  # gaps within the limit
    worst_gap: float  # seconds, the open gap included
    missed_windows: int  # gaps of at least STARVED_INTERVALS intervals (or no save at all: every window)

    @property
    def starved(self) -> bool:
        return self.missed_windows > 0


def pod_saves(
    pod: str,
    completions: Sequence[float],
    *,
    start: float,
    end: float,
    interval: float,
    slack: float = DEFAULT_SLACK,
    big: bool = False,
) -> PodSaves:
    """Judge one pod's Succeeded saves (their completion times, any order) over [start, end]."""
    limit = interval * (1 + slack)
    times = sorted(completions)
    inside = [t for t in times if start <= t <= end]
    before = [t for t in times if t < start]
    chain = ([before[-1]] if before else []) + inside
    gaps = [b - a for a, b in itertools.pairwise(chain)]
    last = chain[-1] if chain else start
    open_gap = end - last
    judged = gaps + ([open_gap] if open_gap > limit else [])
    if not chain:  # nothing at all: every window of the span missed
        missed = max(1, int((end - start) // interval))
        return PodSaves(pod, big, 0, tuple(judged), 0, open_gap, missed)
    missed = sum(1 for g in judged if g >= STARVED_INTERVALS * interval)
    on_time = sum(1 for g in judged if g <= limit)
    worst = max([*gaps, open_gap])
    return PodSaves(pod, big, len(inside), tuple(judged), on_time, worst, missed)


def saves_summary(pods: Sequence[PodSaves], *, interval: float, span: float, slack: float) -> dict[str, Any]:
    """Across pods: the share of gaps on time, the worst gap / interval (all pods, big and small
    apart), starved pods and the saves per pod against the windows the span held."""
    gaps = sum(len(p.gaps) for p in pods)
    on_time = sum(p.on_time for p in pods)
    starved = [p.pod for p in pods if p.starved]

    def worst(sel: Sequence[PodSaves]) -> float | None:
        return round(max(p.worst_gap for p in sel) / interval, 3) if sel else None

    big = [p for p in pods if p.big]
    small = [p for p in pods if not p.big]
    counts = [p.saves for p in pods]
    late = sum(len(p.gaps) - p.on_time for p in pods)
    return {
        "pods": len(pods),
        "interval_s": interval,
        "slack": slack,
        "limit_vs_interval": round(1 + slack, 3),
        "windows_per_pod": round(span / interval, 2),
        "gaps": gaps,
        "gaps_on_time": on_time,
        "late_gaps": late,
        "on_time_share": round(on_time / gaps, 4) if gaps else None,
        "worst_gap_vs_interval": worst(pods),
        "worst_gap_vs_interval_small": worst(small),
        "worst_gap_vs_interval_big": worst(big),
        "median_gap_vs_interval": (
            round(statistics.median(g for p in pods for g in p.gaps) / interval, 3) if gaps else None
        ),
        "saves_per_pod_min": min(counts) if counts else 0,
        "saves_per_pod_median": statistics.median(counts) if counts else 0,
        "starved_pods": starved,
        "missed_windows": sum(p.missed_windows for p in pods),
        "goal_met": bool(pods) and gaps > 0 and on_time == gaps and not starved,
    }


def queue_summary(saves: Sequence[Mapping[str, float | None]], interval: float) -> dict[str, Any]:
    """Over Succeeded saves ({created, started, completed} seconds): the wait from created to claimed and
    created to completed, median and p95, per interval."""
    waits, totals = [], []
    for s in saves:
        created, started, completed = s.get("created"), s.get("started"), s.get("completed")
        if created is None:
            continue
        if started is not None:
            waits.append(started - created)
        if completed is not None:
            totals.append(completed - created)

    def per(x: float | None) -> float | None:
        return round(x / interval, 3) if x is not None else None

    return {
        "saves": len(saves),
        "wait_median_vs_interval": per(percentile(waits, 50)),
        "wait_p95_vs_interval": per(percentile(waits, 95)),
        "total_p95_vs_interval": per(percentile(totals, 95)),
    }


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation between closest ranks; None for no data."""
    vals = sorted(xs)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def cpu_windows(samples: Sequence[tuple[float, float]]) -> list[float]:
    """Cores used in each window between consecutive (wall seconds, cgroup CPU seconds) samples."""
    out = []
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t1 > t0 and c1 >= c0:  # a counter that went back (a restarted container) is skipped
            out.append((c1 - c0) / (t1 - t0))
    return out


def _ratio(a: float | int | None, b: float | int | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def resources_summary(
    cpu_samples: Sequence[tuple[float, float]],
    memory_samples: Sequence[int],
    *,
    kernel_peak: int | None,
    resources: Mapping[str, Any],
) -> dict[str, Any]:
    """The agent's CPU (cores: mean over the span, p95 of the windows) and memory (largest sampled working
    set, the kernel's peak) against the container's declared requests and limits."""
    windows = cpu_windows(cpu_samples)
    if len(cpu_samples) >= 2 and cpu_samples[-1][0] > cpu_samples[0][0]:
        mean = (cpu_samples[-1][1] - cpu_samples[0][1]) / (cpu_samples[-1][0] - cpu_samples[0][0])
    else:
        mean = None
    p95 = percentile(windows, 95)
    req, lim = resources.get("requests") or {}, resources.get("limits") or {}
    cpu_req, cpu_lim = cpu_quantity(req.get("cpu")), cpu_quantity(lim.get("cpu"))
    mem_req, mem_lim = memory_quantity(req.get("memory")), memory_quantity(lim.get("memory"))
    mem_max = max(memory_samples) if memory_samples else None
    return {
        "windows": len(windows),
        "cpu_cores_mean": round(mean, 4) if mean is not None else None,
        "cpu_cores_p95": round(p95, 4) if p95 is not None else None,
        "cpu_request": cpu_req,
        "cpu_limit": cpu_lim,
        "cpu_mean_vs_request": _ratio(mean, cpu_req),
        "cpu_p95_vs_request": _ratio(p95, cpu_req),
        "cpu_p95_vs_limit": _ratio(p95, cpu_lim),
        "memory_max": mem_max,
        "memory_kernel_peak": kernel_peak,
        "memory_request": mem_req,
        "memory_limit": mem_lim,
        "memory_max_vs_request": _ratio(mem_max, mem_req),
        "memory_max_vs_limit": _ratio(mem_max, mem_lim),
        "memory_peak_vs_request": _ratio(kernel_peak, mem_req),
        "memory_peak_vs_limit": _ratio(kernel_peak, mem_lim),
    }


def working_set(usage: int, stat: Mapping[str, int]) -> int:
    """The kubelet's working set: usage less inactive file pages (cgroup v1 total_inactive_file, v2 inactive_file)."""
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return max(0, usage - inactive)


def parse_flat_keyed(text: str) -> dict[str, int]:
    """A cgroup "key value" file (memory.stat, cpu.stat)."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _fmt(x: float | None, unit: str = "x") -> str:
    return "n/a" if x is None else f"{x:.2f}{unit}"


def report(result: Mapping[str, Any]) -> str:
    """The human summary: ratios and counts, an absolute number only beside what it is divided by."""
    s, r = result["saves"], result["agent"]
    big = result.get("big", 0)
    pods = f"{s['pods']} pods" + (
        f" ({big} of {result.get('big_mib')} MiB, the rest {result['mib']} MiB)" if big else ""
    )
    share = 100 * s["on_time_share"] if s["on_time_share"] is not None else None
    lines = [
        f"{pods} on {result['node']}, one SnapshotPolicy every {s['interval_s']:g} s,"
        f" measured over {s['windows_per_pod']:g} intervals:",
        f"- saves on time (each gap between a pod's saves <= {s['limit_vs_interval']:g}x the interval):"
        f" {s['gaps_on_time']}/{s['gaps']} = {_fmt(share, ' %')}"
        f" (goal 100 %: {'met' if s['goal_met'] else 'NOT met'})",
        f"- worst gap / interval: {_fmt(s['worst_gap_vs_interval'])}"
        + (
            f" (small pods {_fmt(s['worst_gap_vs_interval_small'])}, big {_fmt(s['worst_gap_vs_interval_big'])})"
            if big
            else ""
        )
        + f"; median {_fmt(s['median_gap_vs_interval'])}",
        f"- saves per pod: min {s['saves_per_pod_min']}, median {s['saves_per_pod_median']:g}"
        f" of {s['windows_per_pod']:g} windows; starved pods (a window with no save): {len(s['starved_pods'])}"
        + (f" ({', '.join(s['starved_pods'][:10])})" if s["starved_pods"] else ""),
        f"- failed saves: {result.get('failed_saves', 0)}",
    ]
    q = result.get("queue") or {}
    if q:
        lines.append(
            f"- a save's wait from created to claimed / interval: median {_fmt(q.get('wait_median_vs_interval'))},"
            f" p95 {_fmt(q.get('wait_p95_vs_interval'))};"
            f" created -> completed p95 {_fmt(q.get('total_p95_vs_interval'))}"
        )
    lines += [
        f"- agent CPU vs its request ({r['cpu_request']} cores): mean {_fmt(r['cpu_mean_vs_request'])},"
        f" p95 of {result['sample_s']:g} s windows {_fmt(r['cpu_p95_vs_request'])}"
        + (f"; p95 vs limit {_fmt(r['cpu_p95_vs_limit'])}" if r["cpu_limit"] else "; no CPU limit declared"),
        f"- agent memory (working set, largest sample) vs its request ({r['memory_request']} B):"
        f" {_fmt(r['memory_max_vs_request'])}"
        + (f", vs limit {_fmt(r['memory_max_vs_limit'])}" if r["memory_limit"] else "; no memory limit declared")
        + (
            f"; the cgroup's own peak (page cache included) vs request {_fmt(r['memory_peak_vs_request'])}"
            if r["memory_kernel_peak"] is not None
            else ""
        ),
    ]
    return "\n".join(lines)
