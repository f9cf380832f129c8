"""Whether a node-level restore's CRIU starts before the page files are in place (shim/engine/restore.py
criu_first): where they are still far off when the rest is staged, at the rate their chunks have come."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core.errors import InvalidArgument
from shim.engine import restore as R
from shim.engine.staging import StagingGate, StatePaths, wait_staged_images


def test_the_page_files_time_still_to_come_at_the_rate_they_came() -> None:
    assert R.pages_remaining_s(done=25, total=100, elapsed_s=0.1) == pytest.approx(0.3)
    assert R.pages_remaining_s(done=100, total=100, elapsed_s=0.1) == 0.0
    assert R.pages_remaining_s(done=120, total=100, elapsed_s=0.1) == 0.0  # a chunk counted twice: in
    assert R.pages_remaining_s(done=0, total=100, elapsed_s=0.1) is None  # no chunk yet: no rate


def test_criu_starts_first_where_the_page_files_are_far_off() -> None:
    assert R.criu_first(0.3, 0.25) and R.criu_first(0.25, 0.25)
    assert not R.criu_first(0.1, 0.25) and not R.criu_first(0.0, 0.25)
    assert R.criu_first(0.0, None)  # KUBECTL_SNAPSHOT_EARLY_RESTORE=1: always
    assert R.criu_first(None, 0.25)  # not one chunk yet: a slow link


def test_the_progress_counts_the_chunks_and_passes_them_on() -> None:
    now = [10.0]
    seen: list[int] = []
    p = R._PagesProgress(1000, seen.append, lambda: now[0])
    assert p.remaining_s() is None
    p.add(200)
    p.add(50)
    now[0] = 10.5
    assert p.remaining_s() == pytest.approx(1.5)  # 250 bytes in 0.5 s: 750 more take 1.5 s
    assert seen == [200, 50]
    R._PagesProgress(10, None, lambda: 0.0).add(10)  # no progress counter: nothing to pass on


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("", {"early_restore": True, "criu_first_pages_s": R.CRIU_FIRST_PAGES_S}),
        ("auto", {"early_restore": True, "criu_first_pages_s": R.CRIU_FIRST_PAGES_S}),
        (" AUTO ", {"early_restore": True, "criu_first_pages_s": R.CRIU_FIRST_PAGES_S}),
        ("1", {"early_restore": True, "criu_first_pages_s": None}),
        ("0", {"early_restore": False}),
    ],
)
def test_the_early_restore_setting(setting: str, expected: dict[str, Any]) -> None:
    assert R.early_restore_options(setting) == expected


def test_an_unknown_early_restore_setting_is_refused() -> None:
    with pytest.raises(InvalidArgument) as e:
        R.early_restore_options("yes")
    assert "KUBECTL_SNAPSHOT_EARLY_RESTORE" in e.value.message and e.value.hint


@pytest.mark.parametrize(("remaining", "first"), [(0.6, True), (0.1, False), (None, True)])
def test_the_agent_answers_the_images_with_its_choice(tmp_path: Path, remaining: float | None, first: bool) -> None:
    paths = StatePaths(str(tmp_path))
    early = R._EarlyCreate([StagingGate(paths.staging_gate("c1"), two_phase=True)], clock=lambda: 0.0)
    timings: dict[str, float] = {}
    try:
        early.pages_to_come(R.CRIU_FIRST_PAGES_S, timings, remaining)
        assert timings == {"criu_first": float(first)}
        _, pending = wait_staged_images(paths, "c1", timeout_s=1)
        assert pending is not None and pending.criu_first is first
    finally:
        for g in early.gates:
            g.close()
