"""Time as the Kubernetes API writes it: RFC 3339 in UTC to the second (`2026-01-02T03:04:05Z`), and
the one clock the plugin reads for "now" (tests pass their own time instead)."""

from __future__ import annotations

import datetime


def now() -> datetime.datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.datetime.now(datetime.UTC)


def rfc3339(t: float) -> str:
    """Seconds since the epoch as the API server writes timestamps."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse(text: object) -> datetime.datetime | None:
    """An API timestamp (`Z` or an offset, fractions allowed); None when absent or not a timestamp."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def seconds(text: object) -> float | None:
    """An API timestamp as seconds since the epoch; None when absent or not a timestamp."""
    parsed = parse(text)
    return parsed.timestamp() if parsed is not None else None
