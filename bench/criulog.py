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


def action_wait(log: str, action: str) -> float | None:
    """Seconds CRIU spent on `action`: its RPC notification's answer (held at the pages gate by the node
    bundle's launcher, launcher/criurelay.go) and any action script ("Running <action> scripts" to
    the next line after those lines); None when it did not run that action."""
    lines = stamps(log)
    for i, (t, text) in enumerate(lines):
        if text == f"Running {action} scripts":
            for t2, after in lines[i + 1 :]:
                if not after.startswith("\t"):  # "\tRPC" (runc's notification), "\t[script]"
                    return t2 - t
            return None
    return None


def after_memory(log: str) -> float | None:
    """Seconds from CRIU's first step after it put the memory back ("Running post-restore scripts") to its
    last line: the steps runc is told of (post-restore, network-unlock, pre-resume, post-resume), the
    restorer's own finish and, where CRIU runs an action script, a process per step; None without it."""
    lines = stamps(log)
    for t, text in lines:
        if text == "Running post-restore scripts":
            return lines[-1][0] - t
    return None


def tmpfs_mounts(log: str) -> tuple[int, float]:
    """How many tmpfs mounts CRIU restored and the seconds they took: each from its ``Mounting tmpfs @N``
    line to CRIU's next line about that mount (its contents are put back by `tar` in between)."""
    lines = stamps(log)
    count, total = 0, 0.0
    for i, (t, text) in enumerate(lines):
        m = re.search(r"Mounting tmpfs @(\d+)", text)
        if m is None:
            continue
        done = re.compile(rf"mnt-0*{m.group(1)} for {m.group(1)}$")
        for t2, after in lines[i + 1 :]:
            if done.search(after):
                count, total = count + 1, total + (t2 - t)
                break
    return count, total
