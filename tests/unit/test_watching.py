"""The watch loop `snapshot` and `restore` share (app/watching.py), on scripted watch windows and a
fake clock: what it returns, when it re-opens a window, and the errors it passes on."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kubectl_snapshot.app.ports import Obj
from kubectl_snapshot.app.watching import WATCH_WINDOW_S, follow


class Script:
    """Windows of events, each window advancing the clock by its length."""

    def __init__(self, *windows: list[tuple[str, Obj]]) -> None:
        self.windows = list(windows)
        self.now = 0.0
        self.opened: list[int] = []

    def clock(self) -> float:
        return self.now

    def watch(self, window: int) -> Iterable[tuple[str, Obj]]:
        self.opened.append(window)
        events = self.windows.pop(0) if self.windows else []
        yield from events
        self.now += window


def done_when(phase: str, timeout_s: float = 60):  # type: ignore[no-untyped-def]
    def settle(last: Obj | None, elapsed: float) -> Obj | None:
        if last is not None and last["phase"] == phase:
            return last
        if elapsed > timeout_s:
            raise TimeoutError(f"after {elapsed:.0f}s")
        return None

    return settle


def test_returns_the_settled_object_and_ends_a_window_early() -> None:
    script = Script([("ADDED", {"phase": "Pending"}), ("MODIFIED", {"phase": "Done"}), ("MODIFIED", {"phase": "x"})])
    got = follow(
        script.watch,
        settle=done_when("Done"),
        stop=lambda o, _e: o["phase"] == "Done",
        deleted=lambda: LookupError("gone"),
        timeout_s=60,
        clock=script.clock,
    )
    assert got == {"phase": "Done"} and script.opened == [WATCH_WINDOW_S]


def test_quiet_windows_are_reopened_until_the_deadline_then_settle_raises() -> None:
    script = Script()
    with pytest.raises(TimeoutError, match="after 26s"):
        follow(
            script.watch,
            settle=done_when("Done", timeout_s=25),
            stop=lambda _o, _e: False,
            deleted=lambda: LookupError("gone"),
            timeout_s=25,
            clock=script.clock,
        )
    assert script.opened == [10, 10, 6]  # the last window ends a second past the deadline, not 10 s later


def test_a_deletion_is_the_callers_error() -> None:
    script = Script([("ADDED", {"phase": "Pending"}), ("DELETED", {"phase": "Pending"})])
    with pytest.raises(LookupError, match="gone"):
        follow(
            script.watch,
            settle=done_when("Done"),
            stop=lambda _o, _e: False,
            deleted=lambda: LookupError("gone"),
            timeout_s=60,
            clock=script.clock,
        )


def test_a_first_quiet_window_reads_the_object_once() -> None:
    script = Script()
    reads: list[int] = []

    def read() -> Obj:
        reads.append(1)
        return {"phase": "Done"}

    got = follow(
        script.watch,
        settle=done_when("Done"),
        stop=lambda _o, _e: False,
        deleted=lambda: LookupError("gone"),
        timeout_s=60,
        clock=script.clock,
        read=read,
    )
    assert got == {"phase": "Done"} and reads == [1]
