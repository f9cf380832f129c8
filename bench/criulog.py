"""CRIU's logs (dump.log, restore.log at runc's log level 4) read by their time stamps."""

from __future__ import annotations

import itertools
import re


def stamps(log: str) -> list[tuple[float, str]]:
    """(seconds since CRIU started, text) of every time-stamped line."""
    return [
        (float(m.group(1)), m.group(2)) for line in log.splitlines() if (m := re.match(r"\((\d+\.\d+)\) ?(.*)", line))
    ]


def log_gaps(log: str, n: int) -> list[tuple[float, str, str]]:
    """The `n` longest pauses between consecutive log lines: (seconds, line before, line after)."""
    lines = stamps(log)
    gaps = [(b[0] - a[0], a[1][:90], b[1][:90]) for a, b in itertools.pairwise(lines)]
    return sorted(gaps, reverse=True)[:n]


def span(log: str) -> float | None:
    """Seconds from CRIU's first to its last log line (None: no time stamps)."""
    lines = stamps(log)
    return lines[-1][0] if lines else None
